"""Multi-turn, tool-using rollouts (docs/environments.md): the environment protocol
(`protocol`), its isolated worker processes (`pool`, `worker`), tool calls in the model's prompt
format (`tools`), episodes alternating generation and environment steps (`episodes`), their
place in the rollout pipeline (`generator`) and their rewards and metrics (`scoring`). The
tool-use demo's environment is `calc`."""
from rl.envs.protocol import Message, StepResult, ToolCall, load_environment

__all__ = ["Message", "StepResult", "ToolCall", "load_environment"]

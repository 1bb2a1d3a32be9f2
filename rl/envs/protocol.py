"""The environment protocol: what a multi-turn, tool-using rollout asks of a user environment.

An environment is a class named by a dotted path `package.module:Class` (`env.path`):

    class MyEnv:
        def __init__(self, row: dict): ...
        def step(self, message: Message) -> StepResult: ...

`row` is the data row the episode starts from: `prompt`, `answer` and the row's other fields
(`meta`, with `source`). `step` receives each model turn in order (`Message`: its text, the tool
calls parsed from it in the run's prompt format, the turn number) and returns either an
observation (`StepResult(observation="...")`, usually tool results: the model sees it and takes
another turn) or the end of the episode (`StepResult(reward=1.0, done=True)`).

It runs in environment worker processes (`rl.envs.pool`): `__init__` and every `step` run there,
time-limited by `env.step_timeout_s`. Between calls the instance travels to the driver and back
pickled, so its state must be picklable; and it must depend only on the row and the messages
(a step that a stop interrupts is run again from its start by the resumed run). An exception, a crash of the
process, a call past the time limit and anything but a `StepResult` with a string observation or
a finite reward end the episode as failed: reward 0, counted in `env/failures`; the run goes on.
"""
from __future__ import annotations

import importlib
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from rl.config import ConfigError


@dataclass(slots=True)
class ToolCall:
    name: str
    """The tool's name as the model wrote it."""
    arguments: str | dict[str, Any]
    """`raw` tool format: the text after `NAME:`; `deepseek_v4`: {parameter: value}, values of
    `string="false"` parameters JSON-decoded."""


@dataclass(slots=True)
class Message:
    text: str
    """The model's turn, decoded without special tokens (DeepSeek-V4's markers kept)."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    """The tool calls parsed from it, in order (`rl.envs.tools`); empty = a final answer."""
    turn: int = 1
    """1 for the model's first turn."""
    truncated: bool = False
    """The turn was cut at `rollout.max_new_tokens` (it did not end with EOS)."""


@dataclass(slots=True)
class StepResult:
    observation: str | list[str] | None = None
    """What the model sees next (tool results): one string, or one per tool call (each gets its
    own result block where the format has them). Required unless `done`."""
    reward: float | None = None
    """The episode's reward; required when `done`."""
    done: bool = False
    """True ends the episode."""


def load_environment(path: str, key: str = "env.path") -> type:
    """Import `package.module:Class`; ConfigError naming `key` on any failure."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{key}: got {path!r}, expected 'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except BaseException as e:  # an environment's own import errors are config problems
        raise ConfigError(f"{key}: got {path!r}, cannot import module {module_name!r} "
                          f"({type(e).__name__}: {e})") from None
    cls = getattr(module, attr, None)
    if not callable(cls):
        what = "is not callable" if hasattr(module, attr) else "has no attribute"
        raise ConfigError(f"{key}: got {path!r}, module {module_name!r} {what} {attr!r}; "
                          "expected a class Env(row) with a method step(message) -> StepResult")
    return cls


def check_result(value: Any) -> tuple[str | list[str] | None, float | None, bool]:
    """(observation, reward, done) of a `step` result; TypeError / ValueError for garbage."""
    if not isinstance(value, StepResult):
        raise TypeError(f"step returned {type(value).__name__}, expected rl.envs.StepResult")
    if not isinstance(value.done, bool):
        raise TypeError(f"StepResult.done is {value.done!r}, expected True or False")
    if value.done:
        if not isinstance(value.reward, numbers.Real) or not math.isfinite(float(value.reward)):
            raise ValueError(f"StepResult(done=True) has reward {value.reward!r}, expected a "
                             "finite number")
        return None, float(value.reward), True
    obs = value.observation
    if isinstance(obs, str) or (isinstance(obs, list) and obs
                                and all(isinstance(o, str) for o in obs)):
        return obs, None, False
    raise TypeError(f"StepResult(done=False) has observation {obs!r}, expected a string or a "
                    "non-empty list of strings")

"""Rewards: math-verify equivalence, exact match, format, and user plugins by dotted path, run in
worker processes with a time limit per call (`rl.rewards.pool`), optionally sandboxed."""
from rl.rewards.computer import RewardBreakdown, RewardComputer, answer_part
from rl.rewards.plugin import RewardFn, load_reward_function, resolve_reward_function
from rl.rewards.pool import RewardPool
from rl.rewards.verifiers import exact_reward, format_reward, math_equal, math_reward

__all__ = ["RewardBreakdown", "RewardComputer", "RewardFn", "RewardPool", "answer_part",
           "exact_reward", "format_reward", "load_reward_function", "math_equal", "math_reward",
           "resolve_reward_function"]

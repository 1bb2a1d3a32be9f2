"""User reward functions named by a dotted path `package.module:function`.

The function must have the signature

    def my_reward(response: str, answer: str, meta: dict) -> float

where `response` is the decoded completion (no EOS) or, with `reward.answer_after` set
(DeepSeek-V4 thinking: `</think>`), only its text after the last marker, stripped (a response
without the marker scores 0 and the function is not called); `answer` the reference answer of
the example (already extracted), and `meta` the example's other fields (plus `source`). It should
return a finite number; the format reward (`reward.format_weight`) is added on top.

It runs in a reward worker process (`rl.rewards.pool`), not in the driver: the module is imported
once per worker (an import error is a config error at startup), `meta` is a copy (changes do not
come back), and module-level state is per worker. Exceptions, `sys.exit`, a crash of the process,
a call longer than `reward.verify_timeout_s` and non-finite or non-numeric results give the
sample reward 0 and count as a failure, so a buggy plugin never kills a run. For the same
rewards whatever `reward.num_workers`, the result must depend only on the arguments. The module
must be importable where the driver runs (put it on PYTHONPATH).
"""
from __future__ import annotations

import importlib
import math
import numbers
from typing import Any, Callable

from rl.config import ConfigError

RewardFn = Callable[[str, str, dict[str, Any]], float]


def load_reward_function(path: str) -> RewardFn:
    """Import `package.module:function`; ConfigError naming `reward.function` on any failure."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"reward.function: got {path!r}, expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except BaseException as e:  # a plugin's own import errors (even sys.exit) are config problems
        raise ConfigError(f"reward.function: got {path!r}, cannot import module {module_name!r} "
                          f"({type(e).__name__}: {e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        what = "is not callable" if hasattr(module, attr) else "has no attribute"
        raise ConfigError(f"reward.function: got {path!r}, module {module_name!r} {what} "
                          f"{attr!r}; expected a function (response, answer, meta) -> float")
    return fn


def resolve_reward_function(function: str) -> RewardFn:
    """The correctness function named by `reward.function`: `math`, `exact` or a dotted path."""
    from rl.rewards.verifiers import exact_reward, math_reward
    if function == "math":
        return math_reward
    if function == "exact":
        return exact_reward
    return load_reward_function(function)


def reward_value(value: Any) -> float:
    """`value` as a float; TypeError / ValueError when it is not a finite real number."""
    if not isinstance(value, numbers.Real):
        raise TypeError(f"returned {value!r} ({type(value).__name__}), expected a finite number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"returned {value}, expected a finite number")
    return value

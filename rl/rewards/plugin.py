"""User reward functions named by a dotted path `package.module:function`.

The function must have the signature

    def my_reward(response: str, answer: str, meta: dict) -> float

where `response` is the decoded completion (no EOS) or, with `reward.answer_after` set
(DeepSeek-V4 thinking: `</think>`), only its text after the last marker, stripped (a response
without the marker scores 0 and the function is not called); `answer` the reference answer of
the example (already extracted), and `meta` the example's other fields (plus `source`). It should
return a finite number; the format reward (`reward.format_weight`) is added on top. Exceptions and
non-finite or non-numeric results are caught by `RewardComputer`: the sample gets reward 0 and the
failure is counted, so a buggy plugin never kills a run. The module must be importable where
rewards run (the driver; put it on PYTHONPATH).
"""
from __future__ import annotations

import importlib
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
    except Exception as e:  # a plugin's own import errors are config problems to report, too
        raise ConfigError(f"reward.function: got {path!r}, cannot import module {module_name!r} "
                          f"({type(e).__name__}: {e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        what = "is not callable" if hasattr(module, attr) else "has no attribute"
        raise ConfigError(f"reward.function: got {path!r}, module {module_name!r} {what} "
                          f"{attr!r}; expected a function (response, answer, meta) -> float")
    return fn

"""Batch reward computation that a bad reward function cannot crash.

total = correctness + format_weight * format, per sample. A correctness function that raises or
returns a non-number / non-finite value gives that sample a total reward of 0; the failure is
counted in `failures` and the first few messages are kept in `errors` for logging.

With `reward.answer_after` set (DeepSeek-V4's `</think>`), both parts score only the answer, the
text after the last marker; a response without the marker scores 0 without calling the
correctness function (DeepSeek-R1-style RL: no credit for an answer never given outside the
reasoning, and no number picked out of the reasoning).
"""
from __future__ import annotations

import functools
import logging
import math
import numbers
from dataclasses import dataclass
from typing import Callable

from rl.config import RewardConfig
from rl.data.example import Example
from rl.rewards.plugin import RewardFn, load_reward_function
from rl.rewards.verifiers import exact_reward, format_reward, math_reward
from rl.signals import StepAbandoned

log = logging.getLogger(__name__)

MAX_ERRORS_KEPT = 5


def resolve_reward_function(cfg: RewardConfig) -> RewardFn:
    """The correctness function named by `cfg.function` (`math`, `exact` or a dotted path)."""
    if cfg.function == "math":
        return functools.partial(math_reward, timeout_s=cfg.verify_timeout_s)
    if cfg.function == "exact":
        return exact_reward
    return load_reward_function(cfg.function)


def answer_part(response: str, marker: str | None) -> str | None:
    """What the rewards score: the text after the last `marker`, stripped; the whole response
    when `marker` is None; None when the response lacks the marker."""
    if marker is None:
        return response
    _, found, tail = response.rpartition(marker)
    return tail.strip() if found else None


@dataclass(slots=True)
class RewardBreakdown:
    """Per-sample parts, all of length N (the number of responses)."""

    total: list[float]
    correctness: list[float]
    format: list[float]
    failed: list[bool]
    """True where the reward function failed (total forced to 0)."""
    unclosed: list[bool]
    """True where `reward.answer_after` is set and the response lacks it (all parts 0; the
    reward function was not called, so not a failure)."""


class RewardComputer:
    """Scores responses against their examples; see the module docstring for the rules."""

    def __init__(self, cfg: RewardConfig):
        if cfg.answer_after == "auto":
            raise ValueError("reward.answer_after: got 'auto', which `Config` resolves from "
                             "data.prompt_format; a RewardConfig built alone needs null or a "
                             "marker")
        self.cfg = cfg
        self.fn = resolve_reward_function(cfg)  # fails fast on a bad dotted path
        self.failures = 0
        """Samples whose reward function failed, over this object's lifetime."""
        self.errors: list[str] = []
        """The first MAX_ERRORS_KEPT failure messages."""

    def state_dict(self) -> dict:
        """The failure count, carried across resumes (`reward/failures` counts the whole run)."""
        return {"reward_failures_before": self.failures}

    def load_state_dict(self, state: dict) -> None:
        self.failures = state["reward_failures_before"]

    def _correctness(self, i: int, response: str, example: Example) -> float | None:
        try:
            value = self.fn(response, example.answer, example.meta)
            if not isinstance(value, numbers.Real):
                raise TypeError(f"returned {value!r} ({type(value).__name__}), "
                                "expected a finite number")
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"returned {value}, expected a finite number")
            return value
        except Exception as e:  # a user plugin may raise anything; it must not end the run
            self.failures += 1
            message = (f"reward.function {self.cfg.function!r} failed on sample {i} "
                       f"(answer {example.answer!r}): {type(e).__name__}: {e}")[:300]
            if len(self.errors) < MAX_ERRORS_KEPT:
                self.errors.append(message)
                log.warning("%s", message)
            return None

    def score(self, responses: list[str], examples: list[Example],
              cancelled: Callable[[], bool] | None = None) -> RewardBreakdown:
        """Rewards for `responses[i]` against `examples[i]` (equal lengths).

        `cancelled`: checked before each sample; when it returns True, scoring stops with
        StepAbandoned (a stop request must not wait for a slow reward function)."""
        if len(responses) != len(examples):
            raise ValueError(f"RewardComputer: {len(responses)} responses but "
                             f"{len(examples)} examples; expected one example per response")
        out = RewardBreakdown(total=[], correctness=[], format=[], failed=[], unclosed=[])
        for i, (response, example) in enumerate(zip(responses, examples)):
            if cancelled is not None and cancelled():
                raise StepAbandoned(f"stop requested while scoring ({i} of {len(responses)} done)")
            answer = answer_part(response, self.cfg.answer_after)
            if answer is None:
                correct, fmt = 0.0, 0.0
            else:
                correct = self._correctness(i, answer, example)
                fmt = format_reward(answer, self.cfg.response_format)
            failed = correct is None
            out.correctness.append(0.0 if failed else correct)
            out.format.append(fmt)
            out.failed.append(failed)
            out.unclosed.append(answer is None)
            out.total.append(0.0 if failed else correct + self.cfg.format_weight * fmt)
        return out

    def __call__(self, responses: list[str], examples: list[Example]) -> list[float]:
        """Total reward per response (see `score` for the parts)."""
        return self.score(responses, examples).total

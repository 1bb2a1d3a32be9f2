"""Batch reward computation that a bad reward function cannot crash or stall.

total = correctness + format_weight * format, per sample. The correctness function runs in
reward worker processes (`rl.rewards.pool`; `reward.num_workers`, 0 = in the driver). A call
that raises (`sys.exit` included), returns a non-number / non-finite value, runs past
`reward.verify_timeout_s` or takes its worker down gives that sample a total reward of 0; the
failure is counted in `failures` and the first few messages are kept in `errors` for logging.

With `reward.answer_after` set (DeepSeek-V4's `</think>`), both parts score only the answer, the
text after the last marker; a response without the marker scores 0 without calling the
correctness function (DeepSeek-R1-style RL: no credit for an answer never given outside the
reasoning, and no number picked out of the reasoning).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rl.config import RewardConfig
from rl.data.example import Example
from rl.rewards.plugin import resolve_reward_function, reward_value
from rl.rewards.pool import Outcome, RewardPool, auto_workers
from rl.rewards.verifiers import format_reward
from rl.signals import StepAbandoned

log = logging.getLogger(__name__)

MAX_ERRORS_KEPT = 5


def protected_paths(cfg) -> tuple[str, ...]:
    """What a sandboxed reward call may not read, for a `rl.config.Config`: the output
    directory (every run's checkpoints, logs and trajectories) and the data files."""
    paths = [cfg.output_dir, cfg.data.train_path, cfg.data.eval_path]
    return tuple(str(Path(p).resolve()) for p in paths if p)


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
    """Scores responses against their examples; see the module docstring for the rules.

    Owns its worker pool unless given one (`pool`, shared with the evaluation's computer);
    `close` ends the workers (a with-block does)."""

    def __init__(self, cfg: RewardConfig, *, pool: RewardPool | None = None,
                 protect: tuple[str | Path, ...] = ()):
        """`protect`: paths a sandboxed call may not read (the run directory, the data files).
        Raises ConfigError when a plugin cannot be imported."""
        if cfg.answer_after == "auto":
            raise ValueError("reward.answer_after: got 'auto', which `Config` resolves from "
                             "data.prompt_format; a RewardConfig built alone needs null or a "
                             "marker")
        self.cfg = cfg
        self.failures = 0
        """Samples whose reward function failed, over this object's lifetime."""
        self.errors: list[str] = []
        """The first MAX_ERRORS_KEPT failure messages."""
        self.fn = None
        self.pool = pool
        self._owns_pool = pool is None and cfg.num_workers != 0
        if cfg.num_workers == 0:
            if cfg.verify_timeout_s > 0:
                log.warning("reward.num_workers is 0: %r runs in the driver, where "
                            "reward.verify_timeout_s is not enforced and a call that hangs or "
                            "exits the process stops the run", cfg.function)
            self.fn = resolve_reward_function(cfg.function)  # fails fast on a bad dotted path
            self.pool = None
        elif pool is not None and pool.function != cfg.function:
            raise ValueError(f"RewardComputer: the pool runs {pool.function!r}, the config "
                             f"names {cfg.function!r}")
        elif pool is None:
            workers = auto_workers() if cfg.num_workers == "auto" else cfg.num_workers
            self.pool = RewardPool(cfg.function, workers, cfg.verify_timeout_s,
                                   cfg.sandbox if cfg.sandbox.enabled else None,
                                   tuple(str(p) for p in protect))

    def close(self) -> None:
        """End the worker pool, if this computer started it (idempotent)."""
        if self._owns_pool:
            self.pool.close()  # type: ignore[union-attr]  # lint baseline (issue 39)

    def __enter__(self) -> "RewardComputer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def state_dict(self) -> dict:
        """The failure count, carried across resumes (`reward/failures` counts the whole run)."""
        return {"reward_failures_before": self.failures}

    def load_state_dict(self, state: dict) -> None:
        self.failures = state["reward_failures_before"]

    def score(self, responses: list[str], examples: list[Example],
              cancelled: Callable[[], bool] | None = None) -> RewardBreakdown:
        """Rewards for `responses[i]` against `examples[i]` (equal lengths).

        `cancelled`: polled while scoring; when it returns True, scoring stops with
        StepAbandoned (a stop request must not wait for a slow reward function)."""
        if len(responses) != len(examples):
            raise ValueError(f"RewardComputer: {len(responses)} responses but "
                             f"{len(examples)} examples; expected one example per response")
        answers = [answer_part(r, self.cfg.answer_after) for r in responses]
        called = [i for i, a in enumerate(answers) if a is not None]
        outcomes = dict(zip(called, self._correctness(
            [(answers[i], examples[i].answer, examples[i].meta) for i in called], cancelled)))  # type: ignore[misc]  # lint baseline (issue 39)
        out = RewardBreakdown(total=[], correctness=[], format=[], failed=[], unclosed=[])
        for i, (answer, example) in enumerate(zip(answers, examples)):
            ok, value = outcomes.get(i, (True, 0.0))  # no answer: 0, not a failure
            if not ok:
                self._record_failure(i, example, value)
            fmt = 0.0 if answer is None else format_reward(answer, self.cfg.response_format)
            out.correctness.append(value if ok else 0.0)
            out.format.append(fmt)
            out.failed.append(not ok)
            out.unclosed.append(answer is None)
            out.total.append(value + self.cfg.format_weight * fmt if ok else 0.0)
        return out

    def __call__(self, responses: list[str], examples: list[Example]) -> list[float]:
        """Total reward per response (see `score` for the parts)."""
        return self.score(responses, examples).total

    def _correctness(self, calls: list[tuple[str, str, dict]],
                     cancelled: Callable[[], bool] | None) -> list[Outcome]:
        if self.pool is not None:
            return self.pool.map(calls, cancelled)
        out: list[Outcome] = []
        for done, call in enumerate(calls):
            if cancelled is not None and cancelled():
                raise StepAbandoned(f"stop requested while scoring ({done} of {len(calls)} "
                                    f"calls done)")
            try:
                out.append((True, reward_value(self.fn(*call))))  # type: ignore[misc]  # lint baseline (issue 39)
            except (Exception, SystemExit) as e:  # a plugin may raise anything
                out.append((False, f"{type(e).__name__}: {e}"))
        return out

    def _record_failure(self, i: int, example: Example, message: str) -> None:
        self.failures += 1
        if len(self.errors) < MAX_ERRORS_KEPT:
            message = (f"reward.function {self.cfg.function!r} failed on sample {i} "
                       f"(answer {example.answer!r}): {message}")[:300]
            self.errors.append(message)
            log.warning("%s", message)

"""Fault injection, for the tests that prove each recovery path; never set outside tests.

Every `RL_FAULT_*` variable is read here, once, when the object that acts on it is built
(`FaultInjector` in the driver, `TrainerFaults` in each trainer rank, `checkpoint_sleep_s` by the
checkpoint manager): no hot loop reads the environment.

`RL_FAULT_NAN_STEP=STEP[,STEP...]` makes rank 0's losses NaN in those RL steps (the skip must then
happen on every rank); `RL_FAULT_TRAINER_INIT` (any value) makes every trainer rank fail while
starting; `RL_FAULT_CHECKPOINT_SLEEP_S=S` sleeps S seconds between a checkpoint's payload and its
manifest (a window for a crash during the save).

`RL_FAULT_KILL_ENGINE=POINT:STEP[,POINT:STEP...]` kills rollout engine 0 right before the
driver's call at POINT during step STEP (step 0: before the first step, e.g. the warm-start
evaluation), once per entry, so that call meets a dead engine deterministically rather than at a
random moment. Never set outside tests.

Points (where the driver talks to the engines):
- `generate`: collecting a rollout batch;       - `sync`: the weight update;
- `versions`: the version check after a sync;   - `probe`: `sync.check_logprobs` scoring;
- `evaluate`: the periodic evaluation;          - `busy_poll`: reading the engines' busy time.

`RL_FAULT_KILL_TRAINER=STEP[@RESTART][,...]` kills the last trainer rank right before the
driver's train call of step STEP, in the life of the run whose restart count is RESTART (default
0: the first), once: the other ranks then block in their first collective with the dead one, as
after a crash mid-step. The run fails, and the launcher restarts or requeues it (`job.failures`).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

POINTS = ("generate", "sync", "versions", "probe", "evaluate", "busy_poll")
ENV = "RL_FAULT_KILL_ENGINE"
TRAINER_ENV = "RL_FAULT_KILL_TRAINER"
FAULT_NAN_STEP = "RL_FAULT_NAN_STEP"
FAULT_INIT = "RL_FAULT_TRAINER_INIT"
FAULT_CHECKPOINT_SLEEP = "RL_FAULT_CHECKPOINT_SLEEP_S"


def parse(text: str) -> set[tuple[str, int]]:
    """`"evaluate:2,probe:1"` -> {("evaluate", 2), ("probe", 1)}; ValueError naming a bad entry."""
    out = set()
    for entry in filter(None, (e.strip() for e in text.split(","))):
        point, _, step = entry.partition(":")
        if point not in POINTS or not step.isdigit():
            raise ValueError(f"{ENV}: got {entry!r}, expected POINT:STEP with POINT one of "
                             f"{', '.join(POINTS)}")
        out.add((point, int(step)))
    return out


def parse_trainer(text: str) -> set[tuple[int, int]]:
    """`"3,5@1"` -> {(3, 0), (5, 1)}: (step, restart count); ValueError naming a bad entry."""
    out = set()
    for entry in filter(None, (e.strip() for e in text.split(","))):
        step, _, life = entry.partition("@")
        if not step.isdigit() or not (life or "0").isdigit():
            raise ValueError(f"{TRAINER_ENV}: got {entry!r}, expected STEP or STEP@RESTART")
        out.add((int(step), int(life or 0)))
    return out


class FaultInjector:
    def __init__(self, text: str | None = None, trainer_text: str | None = None):
        self.pending = parse(os.environ.get(ENV, "") if text is None else text)
        self.trainer_kills = parse_trainer(os.environ.get(TRAINER_ENV, "")
                                           if trainer_text is None else trainer_text)

    def at(self, point: str, step: int, runtime) -> None:
        """Kill engine 0 if (point, step) is pending (then it is not pending any more)."""
        if (point, step) in self.pending:
            self.pending.discard((point, step))
            log.warning("fault injection: killing rollout engine 0 before %s of step %d", point, step)
            runtime.kill_engine(0)

    def before_train(self, step: int, restart_count: int, runtime) -> None:
        """Kill the last trainer rank if (step, restart_count) is pending."""
        if (step, restart_count) in self.trainer_kills:
            self.trainer_kills.discard((step, restart_count))
            rank = runtime.trainer.num_ranks - 1
            log.warning("fault injection: killing trainer rank %d before the train call of "
                        "step %d", rank, step)
            runtime.kill_trainer(rank)

@dataclass(frozen=True, slots=True)
class TrainerFaults:
    """A trainer rank's injected faults, read from the environment once, when the rank starts."""
    fail_init: bool = False
    """Fail while starting (`RL_FAULT_TRAINER_INIT`)."""
    nan_steps: frozenset[int] = field(default_factory=frozenset)
    """RL steps whose losses become NaN on rank 0 (`RL_FAULT_NAN_STEP`)."""

    @classmethod
    def from_env(cls) -> TrainerFaults:
        steps = os.environ.get(FAULT_NAN_STEP, "")
        return cls(fail_init=bool(os.environ.get(FAULT_INIT)),
                   nan_steps=frozenset(int(v) for v in steps.split(",") if v.strip()))

    def check_init(self, rank: int) -> None:
        if self.fail_init:
            raise RuntimeError(f"trainer rank {rank}: injected start failure ({FAULT_INIT})")

    def poison(self, loss: torch.Tensor, rank: int, step: int) -> torch.Tensor:
        """`loss`, made NaN on rank 0 in the listed steps (one rank only: the others must
        learn of it through the all-reduced finiteness flag)."""
        if rank == 0 and step in self.nan_steps:
            return loss * float("nan")
        return loss


def checkpoint_sleep_s() -> float:
    """Seconds a checkpoint save waits between its payload and its manifest (0: none)."""
    return float(os.environ.get(FAULT_CHECKPOINT_SLEEP, "0") or 0)

"""Fault injection at named points of the driver, for the tests that prove each recovery path.

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
after a crash mid-step. The run fails, and the launcher restarts or requeues it (`launch.failures`).
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

POINTS = ("generate", "sync", "versions", "probe", "evaluate", "busy_poll")
ENV = "RL_FAULT_KILL_ENGINE"
TRAINER_ENV = "RL_FAULT_KILL_TRAINER"


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
            runtime.engines[0].kill()

    def before_train(self, step: int, restart_count: int, runtime) -> None:
        """Kill the last trainer rank if (step, restart_count) is pending."""
        if (step, restart_count) in self.trainer_kills:
            self.trainer_kills.discard((step, restart_count))
            log.warning("fault injection: killing trainer rank %d before the train call of "
                        "step %d", len(runtime.trainers) - 1, step)
            runtime.trainers[-1].kill()

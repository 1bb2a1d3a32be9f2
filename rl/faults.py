"""Fault injection at named points of the driver, for the tests that prove each recovery path.

`RL_FAULT_KILL_ENGINE=POINT:STEP[,POINT:STEP...]` kills rollout engine 0 right before the
driver's call at POINT during step STEP (step 0: before the first step, e.g. the warm-start
evaluation), once per entry, so that call meets a dead engine deterministically rather than at a
random moment. Never set outside tests.

Points (where the driver talks to the engines):
- `generate`: collecting a rollout batch;       - `sync`: the weight update;
- `versions`: the version check after a sync;   - `probe`: `sync.check_logprobs` scoring;
- `evaluate`: the periodic evaluation;          - `busy_poll`: reading the engines' busy time.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

POINTS = ("generate", "sync", "versions", "probe", "evaluate", "busy_poll")
ENV = "RL_FAULT_KILL_ENGINE"


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


class FaultInjector:
    def __init__(self, text: str | None = None):
        self.pending = parse(os.environ.get(ENV, "") if text is None else text)

    def at(self, point: str, step: int, runtime) -> None:
        """Kill engine 0 if (point, step) is pending (then it is not pending any more)."""
        if (point, step) in self.pending:
            self.pending.discard((point, step))
            log.warning("fault injection: killing rollout engine 0 before %s of step %d", point, step)
            runtime.engines[0].kill()

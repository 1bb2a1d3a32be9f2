"""Weights & Biases sink (`logging.wandb`): the run's scalars and its resolved config.

One W&B run per training run: its id is made here, kept in RUN_DIR/tracking.json before the run
starts, and every later life of the run (a requeue, a restart) resumes it (`resume="allow"`).
Local files go to RUN_DIR/wandb (offline mode: RUN_DIR/wandb/offline-run-*, one directory a
life, uploaded with `wandb sync`).

Steps: each scalar is logged with a `step` field, the TensorBoard step, which every chart uses
as its x axis (`define_metric("*", step_metric="step")`). W&B's own row counter `_step` only
increases, and W&B drops a row logged at a step below it; the `step` field has no such rule, so
a resumed life can still log at its checkpoint's step (the restart counters, an evaluation a
stop left to it).
"""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Mapping

from rl.config import WandbConfig
from rl.metrics.sinks import Outcome
from rl.metrics.tracking import TrackingState

STEP_KEY = "step"
"""The field carrying the TensorBoard step in every W&B row."""


class WandbSink:
    name = "wandb"

    def __init__(self, cfg: WandbConfig, run_name: str, run_dir: Path, config: dict[str, Any],
                 state: TrackingState):
        self.cfg, self.run_name, self.run_dir = cfg, run_name, Path(run_dir)
        self.config, self.state = config, state
        self.run: Any = None

    def open(self) -> None:
        import wandb
        saved = self.state.get(self.name)
        if saved is None or saved.get("project") != self.cfg.project:
            saved = {"run_id": uuid.uuid4().hex[:12], "project": self.cfg.project,
                     "entity": self.cfg.entity}
            self.state.set(self.name, saved)  # before init: a life that dies in it resumes it
        self.run = wandb.init(
            project=self.cfg.project, entity=self.cfg.entity, name=self.cfg.name or self.run_name,
            tags=list(self.cfg.tags) or None, id=saved["run_id"], resume="allow",
            mode=self.cfg.mode, dir=str(self.run_dir), config=self.config,
            settings=wandb.Settings(console="off", quiet=True))
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log({STEP_KEY: step, **metrics})

    def close(self, outcome: Outcome) -> None:
        if outcome == "stopped":
            self.run.mark_preempting()  # shown as preempted, not finished, until it resumes
        self.run.finish(exit_code=0 if outcome in ("done", "stopped") else 1)

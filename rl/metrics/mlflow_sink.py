"""MLflow sink (`logging.mlflow`): the run's scalars as metrics, its resolved config as params
(dotted keys, logged once, when the MLflow run is created) and as the artifact `config.yaml`.

One MLflow run per training run: its id goes to RUN_DIR/tracking.json when it is created, and
every later life of the run (a requeue, a restart) resumes it (status RUNNING again) as long as
`logging.mlflow.tracking_uri` is the same. Without a tracking URI the store is a directory,
RUN_DIR/mlruns: MLflow's file store, which MLflow 3 keeps in maintenance mode behind
MLFLOW_ALLOW_FILE_STORE; the sink sets that variable (unless it is set) for a `file:` store, which
needs no server and no network.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Mapping

from rl.config import MlflowConfig
from rl.metrics.sinks import Outcome
from rl.metrics.tracking import TrackingState

MLRUNS_SUBDIR = "mlruns"
STATUS = {"done": "FINISHED", "stopped": "KILLED", "aborted": "FAILED", "failed": "FAILED"}
"""How a life of the run ended -> the MLflow run status it leaves (RUNNING again on resume)."""


def default_tracking_uri(run_dir: Path) -> str:
    return (Path(run_dir) / MLRUNS_SUBDIR).resolve().as_uri()


def is_file_store(uri: str) -> bool:
    """A `file:` URI or a path (MLflow reads a path as a file store)."""
    return uri.startswith(("file:", "/", "."))


class MlflowSink:
    name = "mlflow"

    def __init__(self, cfg: MlflowConfig, run_name: str, run_dir: Path, params: dict[str, str],
                 config: dict[str, Any], state: TrackingState):
        self.cfg, self.run_name, self.run_dir = cfg, run_name, Path(run_dir)
        self.params, self.config, self.state = params, config, state
        self.uri = cfg.tracking_uri or default_tracking_uri(run_dir)
        self.client: Any = None
        self.run_id: str | None = None

    def open(self) -> None:
        if is_file_store(self.uri):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
        self.client = MlflowClient(tracking_uri=self.uri)
        saved = self.state.get(self.name)
        if saved is not None and saved.get("tracking_uri") == self.uri:
            try:
                self.client.update_run(saved["run_id"], status="RUNNING")
                self.run_id = saved["run_id"]
                return
            except MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
        self._create()

    def _create(self) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH
        experiment = self.cfg.experiment or self.run_name
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else self.client.create_experiment(experiment)
        run = self.client.create_run(exp_id, run_name=self.cfg.run_name or self.run_name,
                                     tags={"slurm_rl.run_dir": str(self.run_dir.resolve())})
        self.run_id = run.info.run_id
        self.state.set(self.name, {"run_id": self.run_id, "experiment_id": exp_id,
                                   "tracking_uri": self.uri})
        params = [Param(k, v[:MAX_PARAM_VAL_LENGTH]) for k, v in self.params.items()]
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + MAX_PARAMS_TAGS_PER_BATCH])
        self.client.log_dict(self.run_id, self.config, "config.yaml")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(tag, value, now, step)
                                                    for tag, value in metrics.items()])

    def close(self, outcome: Outcome) -> None:
        self.client.set_terminated(self.run_id, status=STATUS.get(outcome, "FAILED"))

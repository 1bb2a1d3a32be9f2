"""The optional trackers (`logging.wandb`, `logging.mlflow`): which are on, whether their packages
are here, and RUN_DIR/tracking.json, which keeps each tracker's run id across the lives of a run.

A requeued or restarted job comes back to the same run directory and resumes its checkpoint; it
resumes the same W&B / MLflow run as well, from the ids in tracking.json (written atomically
when a tracker's run is first created). `--no-resume` moves the whole run directory aside, so a
run started over gets new tracker runs.
"""
from __future__ import annotations

import importlib
import json
import logging
import threading
from pathlib import Path
from typing import Any

from rl.config import Config, ConfigError, LoggingConfig, to_dict
from rl.metrics.sinks import GuardedSink, TrackingSink

log = logging.getLogger(__name__)

TRACKING_FILE = "tracking.json"

# config section -> (its module, the pip extra that installs it)
_PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


def enabled_trackers(cfg: LoggingConfig) -> list[str]:
    """The trackers a run logs to: `wandb` and/or `mlflow` (W&B's mode `disabled` is off)."""
    on = []
    if cfg.wandb.enabled and cfg.wandb.mode != "disabled":
        on.append("wandb")
    if cfg.mlflow.enabled:
        on.append("mlflow")
    return on


def check_packages(cfg: LoggingConfig) -> None:
    """ConfigError (one line, naming the key and the extra to install) when an enabled tracker's
    package cannot be imported. `launch.submit` calls it before anything starts, the job again
    before its warm start (its nodes may have another environment)."""
    for section in enabled_trackers(cfg):
        module, extra = _PACKAGES[section]
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(
                f"logging.{section}.enabled: got true, but {module} cannot be imported ({e}); "
                f"install it with pip install -e '.[{extra}]', or set logging.{section}.enabled: "
                "false") from None


class TrackingState:
    """RUN_DIR/tracking.json: `{"wandb": {...}, "mlflow": {...}}`, each tracker's run id and where
    it lives. Sinks read their section when they open and write it once, when they create their
    run; the file is replaced atomically (fsync'ed, then renamed)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / TRACKING_FILE
        self._lock = threading.Lock()  # the sinks open on threads of their own

    def get(self, section: str) -> dict[str, Any] | None:
        with self._lock:
            return self._read().get(section)

    def set(self, section: str, value: dict[str, Any]) -> None:
        from rl.checkpoint import atomic_write_text
        with self._lock:
            data = self._read()
            data[section] = value
            atomic_write_text(self.path, json.dumps(data, indent=1, sort_keys=True) + "\n")

    def _read(self) -> dict[str, Any]:
        if not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as e:
            log.warning("%s is unreadable (%s): the trackers start new runs", self.path, e)
            return {}
        return data if isinstance(data, dict) else {}


def flat_config(cfg: Config) -> dict[str, str]:
    """The resolved config as dotted keys -> text (MLflow's params)."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)

    walk("", to_dict(cfg))
    return out


def tracking_sinks(cfg: Config) -> list[GuardedSink]:
    """The enabled trackers, each opening (or resuming) its run on its own thread."""
    state = TrackingState(cfg.run_dir)
    sinks: list[TrackingSink] = []
    for section in enabled_trackers(cfg.logging):
        if section == "wandb":
            from rl.metrics.wandb_sink import WandbSink
            sinks.append(WandbSink(cfg.logging.wandb, cfg.name, cfg.run_dir, to_dict(cfg), state))
        else:
            from rl.metrics.mlflow_sink import MlflowSink
            sinks.append(MlflowSink(cfg.logging.mlflow, cfg.name, cfg.run_dir, flat_config(cfg),
                                    to_dict(cfg), state))
    return [GuardedSink(s) for s in sinks]

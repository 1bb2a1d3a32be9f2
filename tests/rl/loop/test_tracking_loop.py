"""W&B (offline) and MLflow (file store) in a real run (HF engine, 2 ZeRO-3 ranks, no warm start,
like test_faults.py): they receive every scalar TensorBoard receives, at the same steps, and the
resolved config; after a stop (a requeue's signal) the next life resumes the same W&B and MLflow
runs, its steps continuing with none twice; a tracker that raises on every call does not stop it.
No network: offline modes only. The sinks without a loop: tests/rl/test_tracking.py."""
import json
import logging

import numpy as np
import pytest

from tests.helpers.trackers import (mlflow_client, mlflow_scalars, tensorboard_scalars,
                                    wandb_lives, wandb_scalars)
from tests.rl.loop.conftest import make_cfg

pytestmark = pytest.mark.slow

FAST = ("rollout.engine=hf", "model.warm_start=false", "eval.at_start=false")
TRACKERS = ("logging.wandb.enabled=true", "logging.wandb.mode=offline",
            "logging.mlflow.enabled=true")


class Broken:
    """A tracker whose server is gone: every call raises."""
    name = "broken"

    def open(self):
        pass

    def log(self, step, metrics):
        raise ConnectionError("tracker server unreachable")

    def close(self, outcome):
        raise ConnectionError("tracker server unreachable")


def f32(pairs):
    return [(step, float(np.float32(value))) for step, value in pairs]  # what TensorBoard stores


def test_trackers_get_tensorboards_scalars_and_resume_their_runs_after_a_stop(
        tmp_path, ray_local, monkeypatch, caplog):
    from rl import recorder
    from rl.loop import run
    from rl.metrics.sinks import GuardedSink
    from rl.metrics.tracking import TRACKING_FILE, tracking_sinks
    from rl.recorder import RestartInfo
    from rl.signals import StopRequest
    cfg = make_cfg(tmp_path, "tracked", *FAST, "num_steps=3", "eval.every=2",
                   "checkpoint.every=0", *TRACKERS)

    # Life 1: a stop request after step 2's record, as a requeue's USR2 would: checkpoint, exit.
    stop, record = StopRequest(), recorder.Recorder.record

    def record_then_stop(self, step, *args, **kwargs):
        record(self, step, *args, **kwargs)
        if step == 2:
            stop.request("test: requeue after step 2")

    monkeypatch.setattr(recorder.Recorder, "record", record_then_stop)
    first = run(cfg, stop=stop)
    assert first.status == "stopped" and first.step == 2
    ids = json.loads((cfg.run_dir / TRACKING_FILE).read_text())

    # Life 2: resumes from step 2, with a third tracker that raises on every call.
    monkeypatch.setattr(recorder, "tracking_sinks",
                        lambda c: tracking_sinks(c) + [GuardedSink(Broken())])
    with caplog.at_level(logging.WARNING, logger="rl.metrics.sinks"):
        second = run(cfg, restart=RestartInfo(count=1, previous_signal=12))
    assert second.status == "done" and second.step == 3
    assert json.loads((cfg.run_dir / TRACKING_FILE).read_text()) == ids  # the same runs resumed
    broken = [r.getMessage() for r in caplog.records if r.getMessage().startswith("broken:")]
    assert len(broken) == 2 and "log failed (ConnectionError" in broken[0], broken

    tb = tensorboard_scalars(cfg.run_dir)
    assert [s for s, _ in tb["train/loss"]] == [1, 2, 3]  # steps continue, none twice
    assert tb["slurm/restart_count"] == [(0, 0.0), (2, 1.0)]  # each life at its start step
    assert [s for s, _ in tb["eval/pass1"]] == [2, 3]  # eval.every, and the last step
    assert len(tb) > 40  # the documented tags a run writes

    lives = wandb_lives(cfg.run_dir)
    assert [life.run_id for life in lives] == [ids["wandb"]["run_id"]] * 2
    assert [life.exit_code for life in lives] == [0, 0]
    assert lives[0].config["num_steps"] == 3 and lives[0].display_name == "tracked"
    client = mlflow_client(ids["mlflow"]["tracking_uri"])
    run_id = ids["mlflow"]["run_id"]
    for tag, points in tb.items():
        assert f32(wandb_scalars(lives, tag)) == points, tag
        assert f32(mlflow_scalars(client, run_id, tag)) == points, tag
    assert {"step", *tb} == {k for life in lives for row in life.rows for k in row
                              if not k.startswith("_")}  # no other scalars
    mlflow_run = client.get_run(run_id)
    assert set(mlflow_run.data.metrics) == set(tb)
    assert mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.params["rollout.engine"] == "hf"

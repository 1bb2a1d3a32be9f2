"""The tracking sinks (rl/metrics/sinks.py, tracking.py, wandb_sink.py, mlflow_sink.py) without a
loop: one fan-out gives TensorBoard, W&B (offline) and MLflow (file store) the same floats at the
same steps; a second life resumes the same tracker runs from RUN_DIR/tracking.json; a sink that
raises, fails to open or hangs never reaches the caller. The loop end to end:
tests/rl/loop/test_tracking_loop.py."""
import json
import logging
import sys
import threading
import time

import numpy as np
import pytest

from rl.config import ConfigError, load_config
from rl.metrics.sinks import GuardedSink, MetricFanOut
from rl.metrics.tensorboard import MetricsLogger
from rl.metrics.tracking import TRACKING_FILE, check_packages, tracking_sinks
from tests.helpers.trackers import (mlflow_client, mlflow_scalars, tensorboard_scalars,
                                    wandb_lives, wandb_scalars)
from tests.rl.loop.conftest import ROOT


class Recording:
    """A sink that keeps what it is given; `fail_on` names the calls that raise."""

    def __init__(self, name="recording", fail_on=(), block: threading.Event | None = None):
        self.name, self.fail_on, self.block = name, set(fail_on), block
        self.calls: list[tuple] = []

    def open(self):
        self._call("open")

    def log(self, step, metrics):
        if self.block is not None:
            self.block.wait()
        self._call("log", step, dict(metrics))

    def close(self, outcome):
        self._call("close", outcome)

    def _call(self, what, *args):
        if what in self.fail_on:
            raise ConnectionError(f"{self.name} {what}: server unreachable")
        self.calls.append((what, *args))


def tracking_warnings(caplog, name):
    return [r.getMessage() for r in caplog.records
            if r.name == "rl.metrics.sinks" and r.getMessage().startswith(f"{name}:")]


def test_fan_out_gives_every_sink_the_floats_tensorboard_writes(tmp_path):
    good = Recording()
    fan = MetricFanOut(MetricsLogger(tmp_path), [GuardedSink(good)])
    fan.log(1, {"train/loss": np.float32(0.25), "reward/mean": 1})
    fan.log(2, {"train/loss": 0.125, "reward/mean": 0.5})
    with pytest.raises(ValueError, match="not documented"):
        fan.log(3, {"train/loss": 1.0, "no such tag": 1.0})  # refused before any sink sees it
    fan.close("done")
    assert good.calls == [("open",), ("log", 1, {"train/loss": 0.25, "reward/mean": 1.0}),
                          ("log", 2, {"train/loss": 0.125, "reward/mean": 0.5}), ("close", "done")]
    assert all(type(v) is float for call in good.calls[1:3] for v in call[2].values())
    assert tensorboard_scalars(tmp_path)["train/loss"] == [(1, 0.25), (2, 0.125)]


def test_a_raising_sink_never_stops_the_others_and_warns_once(tmp_path, caplog):
    good, bad = Recording(), Recording("flaky", fail_on={"log"})
    fan = MetricFanOut(MetricsLogger(tmp_path), [GuardedSink(bad), GuardedSink(good)])
    with caplog.at_level(logging.WARNING, logger="rl.metrics.sinks"):
        for step in range(1, 4):
            fan.log(step, {"train/loss": float(step)})  # must not raise
        fan.close("done")
    assert [c[1] for c in good.calls if c[0] == "log"] == [1, 2, 3]
    assert bad.calls == [("open",), ("close", "done")]
    warned = tracking_warnings(caplog, "flaky")
    assert len(warned) == 2, warned  # the first failure, then the count at close
    assert "log failed (ConnectionError: flaky log: server unreachable)" in warned[0]
    assert "3 of 5 calls failed" in warned[1]
    assert [s for s, _ in tensorboard_scalars(tmp_path)["train/loss"]] == [1, 2, 3]


def test_a_sink_that_cannot_open_logs_nothing_and_says_so_once(tmp_path, caplog):
    down = Recording("down", fail_on={"open"})
    fan = MetricFanOut(MetricsLogger(tmp_path), [GuardedSink(down)])
    with caplog.at_level(logging.WARNING, logger="rl.metrics.sinks"):
        fan.log(1, {"train/loss": 1.0})
        fan.close("done")
    assert down.calls == []
    warned = tracking_warnings(caplog, "down")
    assert len(warned) == 2 and "open failed" in warned[0], warned


def test_a_hanging_sink_does_not_hold_up_a_step(tmp_path, caplog):
    release = threading.Event()
    slow = GuardedSink(Recording("slow", block=release))
    fan = MetricFanOut(MetricsLogger(tmp_path), [slow])
    t0 = time.perf_counter()
    for step in range(1, 6):
        fan.log(step, {"train/loss": 1.0})
    assert time.perf_counter() - t0 < 1.0
    with caplog.at_level(logging.WARNING, logger="rl.metrics.sinks"):
        slow.close("done", timeout_s=0.2)
    assert "still busy after 0 s at close" in tracking_warnings(caplog, "slow")[0]
    release.set()
    fan.tensorboard.close()


def cfg_with_trackers(tmp_path, *extra):
    return load_config(ROOT / "configs" / "local.yaml", [
        f"output_dir={tmp_path}", "name=tracked", "logging.wandb.enabled=true",
        "logging.wandb.mode=offline", "logging.wandb.tags=[ci]", "logging.mlflow.enabled=true",
        *extra])


def one_life(cfg, steps, start, outcome, resumed):
    """What `rl.recorder.Recorder` does in one life: open at `start`, the restart counters at
    `start`, one row a step, close."""
    fan = MetricFanOut(MetricsLogger(cfg.run_dir, purge_step=start + 1 if resumed else None),
                       tracking_sinks(cfg))
    fan.log(start, {"slurm/restart_count": float(resumed), "slurm/requeue_signal": 12.0 * resumed})
    for step in steps:
        fan.log(step, {"train/loss": 1 / (step + 3), "reward/mean": step * 0.1,
                       "eval/pass1": 0.5 + step / 100})
    fan.close(outcome)


def test_wandb_offline_and_mlflow_file_store_match_tensorboard_and_resume_their_runs(tmp_path):
    cfg = cfg_with_trackers(tmp_path)
    one_life(cfg, [1, 2], start=0, outcome="stopped", resumed=False)
    first = json.loads((cfg.run_dir / TRACKING_FILE).read_text())
    one_life(cfg, [3, 4], start=2, outcome="done", resumed=True)
    assert json.loads((cfg.run_dir / TRACKING_FILE).read_text()) == first  # the same runs

    tb = tensorboard_scalars(cfg.run_dir)
    f32 = lambda pairs: [(s, float(np.float32(v))) for s, v in pairs]  # noqa: E731 - TB stores float32
    lives = wandb_lives(cfg.run_dir)
    assert [life.run_id for life in lives] == [first["wandb"]["run_id"]] * 2
    assert lives[0].display_name == "tracked" and lives[0].tags == ["ci"]
    assert lives[0].config["trainer"]["lr"] == cfg.trainer.lr  # the resolved config
    assert [life.exit_code for life in lives] == [0, 0]
    client = mlflow_client(first["mlflow"]["tracking_uri"])
    run_id = first["mlflow"]["run_id"]
    for tag in ("train/loss", "reward/mean", "eval/pass1", "slurm/restart_count"):
        assert f32(wandb_scalars(lives, tag)) == tb[tag], tag
        assert f32(mlflow_scalars(client, run_id, tag)) == tb[tag], tag
    assert [s for s, _ in tb["train/loss"]] == [1, 2, 3, 4]  # steps continue, none twice
    assert [s for s, _ in tb["slurm/restart_count"]] == [0, 2]  # each life at its start step
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    assert run.data.params["trainer.lr"] == str(cfg.trainer.lr)
    assert run.data.params["logging.wandb.tags"] == '["ci"]'
    assert first["mlflow"]["tracking_uri"] == (cfg.run_dir / "mlruns").resolve().as_uri()


def test_a_changed_tracking_uri_starts_a_new_mlflow_run(tmp_path):
    cfg = cfg_with_trackers(tmp_path, "logging.wandb.enabled=false")
    one_life(cfg, [1], start=0, outcome="stopped", resumed=False)
    before = json.loads((cfg.run_dir / TRACKING_FILE).read_text())["mlflow"]
    moved = cfg_with_trackers(tmp_path, "logging.wandb.enabled=false",
                              f"logging.mlflow.tracking_uri=file://{tmp_path}/elsewhere")
    one_life(moved, [2], start=1, outcome="done", resumed=True)
    after = json.loads((cfg.run_dir / TRACKING_FILE).read_text())["mlflow"]
    assert after["tracking_uri"] == f"file://{tmp_path}/elsewhere"
    assert after["run_id"] != before["run_id"]
    assert mlflow_scalars(mlflow_client(after["tracking_uri"]), after["run_id"],
                          "train/loss") == [(2, 0.2)]


@pytest.mark.parametrize("section, module", [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_an_enabled_tracker_without_its_package_is_a_config_error(tmp_path, monkeypatch, section,
                                                                  module):
    cfg = cfg_with_trackers(tmp_path)
    check_packages(cfg.logging)  # both installed: no error
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    with pytest.raises(ConfigError) as e:
        check_packages(cfg.logging)
    assert str(e.value).startswith(f"logging.{section}.enabled: got true, but {module} cannot "
                                   "be imported")
    assert f"pip install -e '.[{section}]'" in str(e.value) and "\n" not in str(e.value)
    off = cfg_with_trackers(tmp_path, f"logging.{section}.enabled=false")
    check_packages(off.logging)  # a disabled tracker needs no package

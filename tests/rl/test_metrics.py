"""TensorBoard logger (read back by TensorBoard's own readers and a real server) and HDF5 log."""
import json
import logging
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import h5py
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rl.metrics import (FINISH_REASONS, METRIC_TAGS, SCHEMA_VERSION, MetricsLogger,
                        TrajectoryFileError, TrajectoryReader, TrajectoryWriter, markdown_table)

REQUIRED_TAGS = [
    "reward/mean", "reward/std", "reward/failures", "rollout/accuracy", "rollout/response_length",
    "rollout/tokens_per_s", "train/loss", "train/kl", "train/entropy", "train/clip_frac_low",
    "train/clip_frac_high", "train/tis_ratio_mean", "train/tis_ratio_max", "train/tis_ratio_min",
    "train/tis_capped_frac", "train/grad_norm", "train/lr", "train/tokens_per_s", "sync/seconds",
    "sync/gbytes_per_s", "sync/bytes", "time/step", "time/rollout", "time/reward", "time/train",
    "time/sync", "time/eval", "eval/pass1", "eval/mean_reward", "eval/pass_k",
    "faults/rollout_restarts", "faults/skipped_steps", "weights/version",
]


def scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


# ------------------------------------------------------------------ TensorBoard
def test_metric_table_documents_required_tags():
    missing = [t for t in REQUIRED_TAGS if t not in METRIC_TAGS]
    assert not missing
    table = markdown_table()
    assert table.startswith("| tag | meaning |\n| --- | --- |\n")
    assert len(table.strip().splitlines()) == 2 + len(METRIC_TAGS)
    assert "| `sync/gbytes_per_s` |" in table
    assert all(desc.strip() for desc in METRIC_TAGS.values())


def test_monitoring_doc_shows_the_code_tables():
    # docs/monitoring.md carries markdown_table() verbatim, every histogram tag, and the
    # trajectory schema rows of rl/metrics/trajectories.py's docstring
    import rl.metrics.trajectories as trajectories
    from rl.metrics.tensorboard import HISTOGRAM_TAGS
    doc = (Path(__file__).resolve().parents[2] / "docs" / "monitoring.md").read_text()
    assert markdown_table() in doc
    assert all(f"`{tag}` ({desc})" in doc for tag, desc in HISTOGRAM_TAGS.items())
    rows = [line for line in trajectories.__doc__.splitlines() if line.startswith("| `")]
    assert len(rows) >= 15 and all(row in doc for row in rows)


def test_log_and_read_back(tmp_path):
    with MetricsLogger(tmp_path, strict=True) as m:
        for step in range(3):
            m.log(step, {"reward/mean": 0.25 * step, "train/lr": np.float32(1e-5)})
    assert scalars(tmp_path, "reward/mean") == [(0, 0.0), (1, 0.25), (2, 0.5)]
    assert [s for s, _ in scalars(tmp_path, "train/lr")] == [0, 1, 2]
    assert scalars(tmp_path, "train/lr")[0][1] == pytest.approx(1e-5)


def test_purge_step_on_resume_keeps_one_value_per_step(tmp_path):
    with MetricsLogger(tmp_path) as m:
        for step in range(6):
            m.log(step, {"train/loss": float(step)})
    # Crash after step 5, checkpoint at 3: steps 3..5 run again with other values.
    with MetricsLogger(tmp_path, purge_step=3) as m:
        for step in range(3, 6):
            m.log(step, {"train/loss": 10.0 + step})
    assert scalars(tmp_path, "train/loss") == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0),
                                               (5, 15.0)]
    # A second resume purges again.
    with MetricsLogger(tmp_path, purge_step=5) as m:
        m.log(5, {"train/loss": 25.0})
    assert scalars(tmp_path, "train/loss")[-2:] == [(4, 14.0), (5, 25.0)]


def test_tag_checks_and_disabled_logger(tmp_path, caplog):
    with MetricsLogger(tmp_path, strict=True) as m:
        with pytest.raises(ValueError, match="not documented"):
            m.log(0, {"train/made_up": 1.0})
        with pytest.raises(ValueError, match="expected a number"):
            m.log(0, {"train/loss": "high"})
    with MetricsLogger(tmp_path / "lenient", purge_step=None) as m, caplog.at_level(logging.WARNING):
        m.log(0, {"custom/thing": 1.0})
        m.log(1, {"custom/thing": 2.0})
        with pytest.raises(ValueError, match="not documented"):
            m.log(0, {"Bad Tag": 1.0})
    assert sum("custom/thing" in r.getMessage() for r in caplog.records) == 1  # warned once
    assert scalars(tmp_path / "lenient", "custom/thing") == [(0, 1.0), (1, 2.0)]
    off = MetricsLogger(tmp_path / "off", enabled=False)
    off.log(0, {"train/loss": 1.0})
    off.close()
    assert not (tmp_path / "off").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


@pytest.mark.slow
@pytest.mark.parametrize("load_fast", ["true", "false"])
def test_tensorboard_server_serves_tags_after_resume(tmp_path, load_fast):
    """A real `tensorboard` process (Rust and Python loaders) serves the purged curve."""
    with MetricsLogger(tmp_path) as m:
        for step in range(4):
            m.log(step, {"train/loss": float(step), "eval/pass1": 0.1 * step})
    with MetricsLogger(tmp_path, purge_step=2) as m:
        for step in range(2, 4):
            m.log(step, {"train/loss": 10.0 + step, "eval/pass1": 0.5})
    port = _free_port()
    exe = Path(sys.executable).with_name("tensorboard")
    proc = subprocess.Popen([str(exe), "--logdir", str(tmp_path / "tensorboard"), "--port", str(port),
                             "--host", "127.0.0.1", f"--load_fast={load_fast}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/data/plugin/scalars"
    try:
        tags, deadline = {}, time.monotonic() + 60
        while not tags.get(".", {}).get("eval/pass1"):
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            assert time.monotonic() < deadline, "tensorboard did not serve the tags within 60 s"
            try:
                tags = _get_json(f"{base}/tags")
            except OSError:
                pass
            time.sleep(0.2)
        assert {"train/loss", "eval/pass1"} <= set(tags["."])
        query = urllib.parse.urlencode({"run": ".", "tag": "train/loss"})
        points = _get_json(f"{base}/scalars?{query}")
        assert [(step, value) for _, step, value in points] == [(0, 0.0), (1, 1.0), (2, 12.0),
                                                                (3, 13.0)]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------ HDF5 trajectories
def batch(step, n=4, version=None, prompt_base=0):
    """n samples of 2 prompts; response i has i+1 tokens (sample 1 and 3 have equal lengths
    in pairs to exercise equal-length vlen rows)."""
    lengths = [1, 2, 2, 3][:n]
    return dict(
        step=step, weight_version=step if version is None else version,
        prompt_index=[prompt_base + i // 2 for i in range(n)],
        prompt_ids=[[100 + step, 7, 8] for _ in range(n)],
        response_ids=[list(range(10 * step, 10 * step + k)) for k in lengths],
        rollout_logprobs=[[-0.5] * k for k in lengths],
        old_logprobs=[[-0.25] * k for k in lengths],
        reward=[float(i % 2) for i in range(n)], advantage=[1.0, -1.0, 0.5, -0.5][:n],
        finish_reason=["stop", "length", "stop", 1][:n])


def test_write_append_read_vlen_and_schema(tmp_path):
    path = tmp_path / "run" / "trajectories.h5"
    w = TrajectoryWriter(path)
    assert w.append(**batch(0)) == 4
    assert w.append(**batch(1)) == 8
    with h5py.File(path, "r") as f:
        assert f.attrs["schema_version"] == SCHEMA_VERSION == 2
        assert tuple(json.loads(f.attrs["finish_reasons"])) == FINISH_REASONS
        assert f["response_ids"].dtype.metadata["vlen"] == np.int32
        assert f["rollout_logprobs"].dtype.metadata["vlen"] == np.float32
        assert f["step"].maxshape == (None,) and f["step"].chunks is not None
    with TrajectoryReader(path) as r:
        assert r.num_rows == 8 and r.steps() == [0, 1]
        row = r.row(7)
        assert row["step"] == 1 and row["weight_version"] == 1
        assert row["prompt_index"] == 1 and row["sample_index"] == 1
        assert row["response_ids"].tolist() == [10, 11, 12] and row["response_ids"].dtype == np.int32
        assert row["response_length"] == 3 and row["prompt_length"] == 3
        assert row["prompt_ids"].tolist() == [101, 7, 8]
        assert row["rollout_logprobs"].tolist() == [-0.5] * 3
        assert row["old_logprobs"].tolist() == [-0.25] * 3
        assert row["finish_reason"] == "length" and row["advantage"] == -0.5
        assert r.row(1)["response_ids"].tolist() == [0, 1]
        s0, s1 = r.step_summaries()
        assert (s1.step, s1.num_rows, s1.reward_mean, s1.reward_std) == (1, 4, 0.5, 0.5)
        assert s1.response_length_mean == 2.0 and s1.truncated_frac == 0.5
        assert (s0.weight_version_min, s0.weight_version_max) == (0, 0)
        with pytest.raises(IndexError):
            r.row(8)


def test_append_validates_batch(tmp_path):
    w = TrajectoryWriter(tmp_path / "t.h5")
    bad = batch(0)
    bad["rollout_logprobs"] = [[-0.5]] * 4  # response 3 has 3 tokens
    with pytest.raises(ValueError, match=r"rollout_logprobs\[1\] has 1 values"):
        w.append(**bad)
    with pytest.raises(ValueError, match="reward has 3 rows"):
        w.append(**{**batch(0), "reward": [0.0, 1.0, 0.0]})
    with pytest.raises(ValueError, match="finish_reason"):
        w.append(**{**batch(0), "finish_reason": ["stop", "eos", "stop", "stop"]})
    assert w.num_rows() == 0  # nothing half-written
    w.append(**{**batch(2), "old_logprobs": None, "weight_version": [1, 1, 2, 2]})
    with pytest.raises(ValueError, match="older than"):
        w.append(**batch(1))
    with TrajectoryReader(w.path) as r:
        assert r.row(0)["old_logprobs"].size == 0
        assert r.column("weight_version").tolist() == [1, 1, 2, 2]


def test_truncate_for_resume(tmp_path):
    w = TrajectoryWriter(tmp_path / "t.h5")
    for step in range(4):
        w.append(**batch(step))
    assert w.truncate(1) == 8 and w.num_rows() == 8
    assert w.truncate(1) == 0
    w = TrajectoryWriter(tmp_path / "t.h5")  # reopening an existing file keeps it
    w.append(**batch(2, version=7))
    with TrajectoryReader(w.path) as r:
        assert r.steps() == [0, 1, 2] and r.num_rows == 12
        assert r.row(8)["weight_version"] == 7 and r.row(11)["response_ids"].tolist() == [20, 21, 22]


def test_truncate_compacts_out_of_order_rows(tmp_path):
    w = TrajectoryWriter(tmp_path / "t.h5")
    w.append(**batch(0, n=2))
    w.append(**batch(1, n=2))
    with h5py.File(w.path, "a") as f:  # corrupt the order by hand: rows become steps 0, 5, 1, 1
        f["step"][1] = 5
    assert w.truncate(1) == 1
    with TrajectoryReader(w.path) as r:
        assert r.column("step").tolist() == [0, 1, 1]
        assert [r.row(i)["response_ids"].tolist() for i in range(3)] == [[0], [10], [10, 11]]


def test_interrupted_append_leaves_file_readable(tmp_path):
    w = TrajectoryWriter(tmp_path / "t.h5")
    w.append(**batch(0))
    with h5py.File(w.path, "a") as f:  # a crash after some columns grew, before `step` did
        f["reward"].resize((9,))
        f["response_ids"].resize((9,))
    with TrajectoryReader(w.path) as r:
        assert r.num_rows == 4 and len(r.column("reward")) == 4
    assert w.append(**batch(1)) == 8
    with TrajectoryReader(w.path) as r:
        assert r.column("reward").tolist() == [0, 1, 0, 1] * 2


def test_reader_errors(tmp_path):
    with pytest.raises(TrajectoryFileError, match="no such"):
        TrajectoryReader(tmp_path / "missing.h5")
    (tmp_path / "junk.h5").write_text("not hdf5")
    with pytest.raises(TrajectoryFileError, match="cannot open"):
        TrajectoryReader(tmp_path / "junk.h5")
    with h5py.File(tmp_path / "v9.h5", "w") as f:
        f.attrs["schema_version"] = 9
    with pytest.raises(TrajectoryFileError, match="schema_version 9"):
        TrajectoryWriter(tmp_path / "v9.h5")

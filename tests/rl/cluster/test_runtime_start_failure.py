"""A worker that fails while the runtime starts must not leave the driver hanging.

Plain-process workers (the GPU machine has no Ray) are non-daemon processes: before the fix a
trainer that failed to start left the engine process waiting on its pipe, and multiprocessing
joined it at exit, so the driver printed its error and then never exited.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent("""
    import sys
    from rl.config import load_config
    from rl.models.presets import build_preset
    from rl.runtime import Placement, Runtime

    model_dir = build_preset("tiny-qwen3-moe", sys.argv[1] + "/model")
    cfg = load_config("configs/local.yaml", ["rollout.engine=hf", "trainer.num_ranks=1",
                                             "trainer.zero_stage=2"])
    try:
        Runtime(cfg, str(model_dir), 4, placement=Placement("proc", "cpu", "cpu"))
    except Exception as e:  # the worker's error, re-raised in the driver
        print("START FAILED:", e, flush=True)
""")


def test_a_failed_start_kills_the_started_workers_and_the_driver_exits(tmp_path):
    env = dict(os.environ, RL_FAULT_TRAINER_INIT="1", PYTHONPATH=str(REPO))
    try:
        out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        raise AssertionError("the driver did not exit after the trainer failed to start "
                             f"(stdout: {e.stdout!r})") from None
    assert out.returncode == 0, out.stderr[-2000:]
    assert "START FAILED" in out.stdout and "injected start failure" in out.stdout, out.stdout

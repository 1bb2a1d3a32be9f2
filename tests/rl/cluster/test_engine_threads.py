"""`rollout.torch_threads`: the engine processes' torch / OpenMP threads, apart from the trainer's.

Real plain-process workers (the placement the GPU machine uses): the engine process reports its
OMP_NUM_THREADS and torch's thread count."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rl.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent("""
    import sys
    from rl.config import load_config
    from rl.models.presets import build_preset
    from rl.runtime import Placement, Runtime

    model_dir = build_preset("tiny-qwen3-moe", sys.argv[1] + "/model")
    cfg = load_config("configs/local.yaml", ["rollout.engine=hf", "trainer.num_ranks=1",
                                             "trainer.zero_stage=2", *sys.argv[2:]])
    rt = Runtime(cfg, str(model_dir), 4, placement=Placement("proc", "cpu", "cpu"))
    try:
        threads, omp = rt.rollout.engines[0].call("threads").result(timeout=60)
        print("ENGINE", omp, threads, flush=True)
    finally:
        rt.shutdown()
""")


def run(tmp_path, *overrides) -> str:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), *overrides], cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return next(line for line in out.stdout.splitlines() if line.startswith("ENGINE"))


@pytest.mark.slow
def test_engine_threads_follow_rollout_torch_threads_else_the_trainers(tmp_path):
    assert run(tmp_path / "a", "rollout.torch_threads=2") == "ENGINE 2 2"
    assert run(tmp_path / "b") == "ENGINE 1 1"    # null: trainer.torch_threads (1)


def test_rollout_torch_threads_must_be_positive():
    with pytest.raises(ConfigError, match=r"rollout\.torch_threads.*0.*null or an integer > 0"):
        load_config(str(REPO / "configs/local.yaml"), ["rollout.torch_threads=0"])

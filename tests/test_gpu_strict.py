"""GPU test gating: a skipped `gpu` test fails under RL_GPU_STRICT=1, and bench/run_gpu.sh
returns non-zero when a section fails (both checked here, on a machine without CUDA)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
GPU_TEST = "tests/gpu/test_sync_gpu.py"

pytestmark = pytest.mark.skipif(torch.cuda.device_count() >= 2,
                                reason="checks the gating where the GPU tests cannot run")


def _pytest(strict: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "RL_GPU_STRICT": "1" if strict else "0"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           GPU_TEST], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_gpu_skips_pass_normally_and_fail_in_strict_mode():
    normal = _pytest(strict=False)
    assert normal.returncode == 0 and "skipped" in normal.stdout, normal.stdout[-2000:]
    strict = _pytest(strict=True)
    assert strict.returncode == 1, strict.stdout[-2000:]
    assert "RL_GPU_STRICT=1: this GPU test skipped" in strict.stdout
    assert re.search(r"\d+ (failed|errors?)\b", strict.stdout.splitlines()[-1]), strict.stdout


def test_run_gpu_sh_returns_nonzero_when_a_section_fails(tmp_path):
    # The script runs `python3`: make it this interpreter, so the tests really run (and fail
    # strictly) rather than fail to import torch.
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
    proc = subprocess.run(["bash", "bench/run_gpu.sh", "tests_sync_only"], cwd=ROOT,
                          env={**os.environ, "OUT": str(tmp_path), "PATH": path},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "=== tests_sync_only rc=1 " in proc.stdout, proc.stdout
    assert "FAILED SECTIONS: tests_sync_only" in proc.stdout

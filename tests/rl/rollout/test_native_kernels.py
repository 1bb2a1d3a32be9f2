"""Triton decode kernels = torch references, under the Triton interpreter on CPU (~7 s)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_triton_kernels_match_torch_references_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "tests.rl.rollout.kernel_cases"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
    assert "decode attention block_l=16" in proc.stdout and "grouped fp8" in proc.stdout
    assert "fp8 kv decode attention block_l=16" in proc.stdout

"""Each benchmark's reduced CPU mode (`--smoke`) runs end to end and writes its json + md."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("name, needs", [("rollout", None), ("weight_sync", None),
                                         ("train", "deepspeed"), ("async_rl", "deepspeed"),
                                         ("v4_attention", None), ("routing_replay", None),
                                         ("fp8_gemm", None), ("moe_actor", "deepspeed"),
                                         ("decode_profile", None), ("decode_attention", None),
                                         ("sampling", None), ("rewards", None),
                                         ("dynamic_sampling", "deepspeed")])
def test_benchmark_smoke_mode(name, needs, tmp_path):
    if needs:
        pytest.importorskip(needs)
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", f"bench.{name}", "--smoke", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / f"{name}_smoke.json").read_text())
    assert result["device"] and result["date"] and result["rows"]
    table = (tmp_path / f"{name}_smoke.md").read_text()
    assert table.count("\n|") >= 2 + len(result["rows"]) - 1

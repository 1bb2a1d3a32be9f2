"""`python -m bench.packing --smoke`: padded vs packed micro-batches on CPU at tiny dims; the
result files carry the fields the GPU table reports, the two paths' log-probs agree, packing
counts what each path computes, and each mix's line is written."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_packing_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "bench.packing", "--smoke", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "packing_smoke.json").read_text())
    assert result["command"].startswith("python -m bench.packing --smoke")
    rows = result["rows"]
    assert {(r["mix"], r["path"]) for r in rows} == {
        (m, p) for m in ("demo", "long_tail") for p in ("limit", "padded", "packed")}
    for mix in ("demo", "long_tail"):
        at = {r["path"]: r for r in rows if r["mix"] == mix}
        padded, packed = at["padded"], at["packed"]
        assert packed["real_tokens"] == padded["real_tokens"]
        assert padded["computed_tokens"] >= padded["real_tokens"]
        assert packed["computed_tokens"] >= packed["real_tokens"]  # padding at the bins' ends
        assert packed["logp_max_diff"] < 1e-4  # fp32: the same log-probs
        assert packed["speedup"] == pytest.approx(packed["tokens_per_s"] / padded["tokens_per_s"])
        assert at["limit"]["seconds"] == pytest.approx(
            padded["seconds"] * padded["real_tokens"] / padded["computed_tokens"])
    demo = {r["path"]: r for r in rows if r["mix"] == "demo"}
    assert demo["padded"]["computed_tokens"] > demo["padded"]["real_tokens"]  # padding to save
    table = (tmp_path / "packing_smoke.md").read_text()
    assert "demo mix: packed " in table and "long_tail mix: packed " in table
    assert "the target is decided on a GPU only" in table

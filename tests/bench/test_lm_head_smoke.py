"""`python -m bench.lm_head --smoke`: the full-logits and chunked LM-head paths on CPU at tiny
dims in BF16; the result files carry every field the GPU table reports, the two paths agree on
the loss and gradients, and each target line is written."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROW_FIELDS = {"tokens", "path", "chunk_rows", "result", "seconds", "limit_s", "x_limit", "loss",
              "entropy", "grad_h", "grad_w"}


@pytest.mark.slow
def test_lm_head_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "bench.lm_head", "--smoke", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "lm_head_smoke.json").read_text())
    for key in ("device", "date", "command", "bf16_peak_TFLOPs", "vocab", "hidden", "rows",
                "notes"):
        assert result[key], key
    assert result["command"].startswith("python -m bench.lm_head --smoke")
    rows = result["rows"]
    assert {(r["tokens"], r["path"]) for r in rows} == {
        (t, p) for t in (64, 128) for p in ("limit", "full", "chunked")}
    for tokens in (64, 128):
        at = {r["path"]: r for r in rows if r["tokens"] == tokens}
        for path in ("full", "chunked"):
            assert at[path]["result"] == "ok" and ROW_FIELDS <= set(at[path]), path
            assert at[path]["seconds"] > at[path]["limit_s"] == at["limit"]["seconds"] > 0
        full, ours = at["full"], at["chunked"]
        assert ours["chunk_rows"] == 16 and full["chunk_rows"] is None
        # BF16 both ways: the same logits, log-probs summed in fp32
        assert ours["loss"] == pytest.approx(full["loss"], rel=1e-4, abs=1e-3)
        for key in ("grad_h", "grad_w", "entropy"):
            assert ours[key] == pytest.approx(full[key], rel=1e-2), key
    table = (tmp_path / "lm_head_smoke.md").read_text()
    assert table.count("\n| 128 | ") == 3
    for tokens in (64, 128):
        assert f"target time <= 1.3x full logits, chunked (16 rows) at {tokens:,} tokens: " in table
    assert "smoke run: not a measurement" in table
    assert "the memory target is decided on a GPU only" in table

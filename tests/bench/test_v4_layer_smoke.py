"""`python -m bench.v4_layer --smoke`: two tiny V4 layers (CSA, HCA) on CPU in BF16 through the
three paths; the result files carry every field the GPU table reports, and the paths agree on the
loss."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROW_FIELDS = {"tokens", "path", "result", "seconds", "limit_s", "tokens_per_s", "MFU_active",
              "MFU_with_core", "loss", "grad_norm", "speedup_vs_eager"}


@pytest.mark.slow
def test_v4_layer_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "bench.v4_layer", "--smoke", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "v4_layer_smoke.json").read_text())
    for key in ("device", "date", "command", "bf16_peak_TFLOPs", "params", "active_params",
                "config", "rows", "notes"):
        assert result[key], key
    assert result["command"].startswith("python -m bench.v4_layer --smoke")
    assert 0 < result["active_params"] < result["params"]
    assert result["config"]["layer_types"] == ["compressed_sparse_attention",
                                               "heavily_compressed_attention"]
    rows = {r["path"]: r for r in result["rows"]}
    assert set(rows) == {"eager", "project", "fused"}
    for path, row in rows.items():
        assert row["result"] == "ok", path
        assert ROW_FIELDS <= set(row), (path, ROW_FIELDS - set(row))
        assert row["seconds"] > 0 and 0 < row["MFU_active"] < row["MFU_with_core"]
        assert row["limit_s"] < row["seconds"]
    # BF16 on every path: eager rounds its scores to bf16, the project's paths keep them fp32;
    # fused mixes the streams in fp32 (rl.models.v4_layer)
    eager = rows["eager"]["loss"]
    for path in ("project", "fused"):
        ours = rows[path]["loss"]
        assert abs(ours - eager) / abs(eager) < 1e-2, (path, ours, eager)
        assert abs(rows[path]["grad_norm"] / rows["eager"]["grad_norm"] - 1) < 5e-2, path
    assert abs(rows["fused"]["loss"] / rows["project"]["loss"] - 1) < 5e-3
    table = (tmp_path / "v4_layer_smoke.md").read_text()
    assert table.count("\n| 64 | ") == 3
    assert "target >= 35% MFU on active params at 64 tokens: NOT MET" in table
    for pair in ("project vs eager", "fused vs eager", "fused vs project"):
        assert f"loss {pair} at 64 tokens" in table, pair

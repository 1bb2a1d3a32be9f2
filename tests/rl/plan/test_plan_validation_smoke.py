"""bench/plan_validation.py --smoke: every code path of the GPU validation runs on the CPU."""
import json

import pytest


@pytest.mark.slow
def test_validation_smoke_writes_json_and_table(tmp_path):
    from bench.plan_validation import JUDGED, main
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "plan_validation.json").read_text())
    assert result["smoke"] is True
    rows = result["rows"]
    assert {r["model"] for r in rows} == {"dense-qwen3-0.6b", "moe-qwen3-64x8"}
    judged = [r for r in rows if r["quantity"] in JUDGED]
    assert len(judged) == 2 * len(JUDGED)
    # On the CPU the "measured" column is what the tensors hold; the planner's formulas for
    # weights (BF16 and block FP8), optimizer state and KV cache must equal it exactly.
    assert all(r["measured_bytes"] == r["planned_bytes"] for r in judged), [
        (r["model"], r["quantity"], r["planned_bytes"], r["measured_bytes"]) for r in judged
        if r["measured_bytes"] != r["planned_bytes"]]
    assert all(r["measured_bytes"] is None for r in rows if r["quantity"].startswith("activations"))
    table = (tmp_path / "plan_validation.md").read_text()
    assert "| moe-qwen3-64x8 | rollout weights FP8 |" in table and "SMOKE" in table

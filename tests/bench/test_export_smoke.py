"""`python -m bench.export --smoke`: the whole benchmark on CPU with tiny V4 dims (a real one-rank
ZeRO-3 checkpoint, the plain copy, three `launch.export` formats, zero_to_fp32), and the pieces
its figures rest on: per-child peak memory, the partial copy's scaling, the deepseek-v4 check."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bench.export import check_deepseek, plain_copy, run_child
from rl.models.convert.quantize import quantize_fp8

ROOT = Path(__file__).resolve().parents[2]
ROW_FIELDS = {"row", "seconds", "rc", "peak_rss_GiB", "peak_anon_GiB", "peak_file_GiB",
              "checkpoint_GiB", "output_GiB", "tensors", "ckpt_GBps", "vs_copy", "export_s",
              "shards", "largest_shard_GiB", "largest_tensor_GiB", "rss_limit_GiB",
              "rss_target", "anon_target", "time_target", "verified"}


def test_run_child_measures_each_child_apart():
    """The peak of a child that holds 400 MiB, then of one that holds nothing: each its own
    (RUSAGE_CHILDREN alone would report the larger one for both)."""
    big = run_child([sys.executable, "-c", "import time; b = b'x' * (400 << 20); "
                     "time.sleep(0.5); print('held', len(b))"], "big")
    small = run_child([sys.executable, "-c", "print('small')"], "small")
    assert big["rc"] == 0 and big["tail"] == [f"held {400 << 20}"]
    assert big["peak_rss_GiB"] > 0.39 and big["peak_anon_GiB"] > 0.39
    assert small["rc"] == 0 and small["peak_rss_GiB"] < 0.1
    assert run_child([sys.executable, "-c", "raise SystemExit(3)"], "fails")["rc"] == 3


def test_plain_copy_scales_a_partial_copy_to_the_whole(tmp_path):
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "a").write_bytes(os.urandom(3 << 20))
    (src / "d" / "b").write_bytes(os.urandom(1 << 20))
    whole = plain_copy(src, tmp_path / "c1", room=1 << 30)
    assert whole["copied_GiB"] * 2**30 == 4 << 20 and not whole["verified"]
    assert whole["seconds"] == whole["measured_s"]
    part = plain_copy(src, tmp_path / "c2", room=2 << 20)
    assert part["copied_GiB"] * 2**30 == 2 << 20 and part["verified"].startswith("partial")
    assert part["seconds"] == pytest.approx(2 * part["measured_s"])
    assert not (tmp_path / "c1").exists() and not (tmp_path / "c2").exists()


def test_check_deepseek_finds_a_weight_beyond_its_bound(tmp_path):
    """A block-FP8 weight converted back exactly passes; one element moved past its bound, or
    an unquantised tensor changed, fails."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 192, generator=g) * 0.02).to(torch.bfloat16)
    norm = torch.rand(192, generator=g) + 0.5
    q, scale = quantize_fp8(w.float())
    exported = tmp_path / "exported"
    exported.mkdir()
    save_file({"x.weight": q, "x.scale": scale.to(torch.float8_e8m0fnu), "n.weight": norm},
              str(exported / "model-00001-of-00001.safetensors"))
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:256, :192]
    back = {"x.weight": (q.float() * full).to(torch.bfloat16), "n.weight": norm}
    sample = {"x.weight": w, "n.weight": norm}

    def verdict(tensors: dict) -> str:
        out = tmp_path / "back"
        out.mkdir(exist_ok=True)
        save_file(tensors, str(out / "model-00001-001.safetensors"))
        return check_deepseek(exported, out, sample)
    assert verdict(back).startswith("ok: 1 fp8 / 0 fp4 sampled weights within bound"), \
        verdict(back)
    off = back["x.weight"].clone()
    off[3, 5] += 17 * full[3, 5]  # more than half an e4m3 step at any value
    assert verdict({**back, "x.weight": off}).startswith("FAILED: x.weight (fp8)")
    assert verdict({**back, "n.weight": norm + 1e-3}).startswith("FAILED: n.weight")


@pytest.mark.slow
def test_export_bench_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    work = tmp_path / "work"
    proc = subprocess.run([sys.executable, "-m", "bench.export", "--smoke", "--out",
                           str(tmp_path), "--work", str(work)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "export_smoke.json").read_text())
    for key in ("device", "date", "command", "params", "experts", "checkpoint_GiB",
                "baseline_GiB", "fs", "free_GiB", "rows", "notes"):
        assert result[key], key
    assert result["command"].startswith("python -m bench.export --smoke")
    rows = {r["row"]: r for r in result["rows"]}
    assert list(rows) == ["trainer checkpoint (save)", "plain copy (the limit)", "export hf",
                          "export deepseek-v4 fp4", "DeepSpeed zero_to_fp32 (naive)",
                          "export deepseek-v4 fp8"]
    checkpoint = rows["trainer checkpoint (save)"]
    assert checkpoint["checkpoint_GiB"] == result["checkpoint_GiB"] > 0
    assert checkpoint["path"].endswith("run/checkpoints/step_000001")
    copy = rows["plain copy (the limit)"]
    assert copy["copied_GiB"] == pytest.approx(copy["checkpoint_GiB"]) and copy["seconds"] > 0
    assert len(copy["page_cache_GiB"]) == 2  # the page cache around dropping the checkpoint
    for name in ("export hf", "export deepseek-v4 fp4", "export deepseek-v4 fp8"):
        row = rows[name]
        assert ROW_FIELDS <= set(row), (name, ROW_FIELDS - set(row))
        assert row["rc"] == 0 and row["verified"].startswith("ok: "), (name, row["verified"])
        assert row["seconds"] > row["export_s"] > 0 and row["tensors"] > 0
        assert row["peak_rss_GiB"] >= row["peak_anon_GiB"] > 0.1  # torch alone is more
        assert row["rss_limit_GiB"] == pytest.approx(
            result["baseline_GiB"] + row["largest_shard_GiB"] + row["largest_tensor_GiB"] + 2)
        assert row["vs_copy"] == pytest.approx(row["seconds"] / copy["seconds"])
        assert row["shards"] > 1  # --smoke caps the shards at 0.00005 GiB
    assert rows["export hf"]["verified"] == (f"ok: all {rows['export hf']['tensors']} names; "
                                             "74 sampled tensors bit for bit")
    assert " 12 fp4 " in rows["export deepseek-v4 fp4"]["verified"]
    assert " 0 fp4 " in rows["export deepseek-v4 fp8"]["verified"]
    assert rows["export deepseek-v4 fp4"]["convert_back_s"] > 0
    naive = rows["DeepSpeed zero_to_fp32 (naive)"]
    assert naive["rc"] == 0 and naive["verified"].startswith("ok: ") and naive["tensors"] > 0
    table = (tmp_path / "export_smoke.md").read_text()
    assert table.count("\n| export ") == 3
    assert "dropping the checkpoint's pages took the page cache from" in table
    assert "export hf: peak RSS" in table and "x the plain copy (target <= 2): NOT MET, smoke" \
        in table
    assert not work.exists()  # removed without --keep

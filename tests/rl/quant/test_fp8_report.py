"""Quantisation error report: values, byte counts, formatting."""
import torch

from rl.quant.report import format_report, quantization_report


def named():
    g = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(256, 256, generator=g)),
            ("b.weight", torch.randn(130, 200, generator=g) * 0.01),
            ("zero.weight", torch.zeros(64, 64)),
            ("experts.gate_up_proj", torch.randn(2, 128, 64, generator=g))]


def test_report_rows():
    rows = quantization_report(named())
    assert [r["name"] for r in rows] == ["a.weight", "b.weight", "zero.weight", "experts.gate_up_proj"]
    a, b, zero, experts = rows
    assert set(a) == {"name", "shape", "rel_err", "max_abs_err", "bytes_bf16", "bytes_fp8"}
    assert a["shape"] == (256, 256) and experts["shape"] == (2, 128, 64)
    assert 1e-3 < a["rel_err"] < 0.04 and 1e-3 < b["rel_err"] < 0.04
    assert zero["rel_err"] == 0.0 and zero["max_abs_err"] == 0.0
    assert a["bytes_bf16"] == 2 * 256 * 256 and a["bytes_fp8"] == 256 * 256 + 4 * 4
    assert experts["bytes_fp8"] == 2 * 128 * 64 + 4 * 2
    # e4m3 spacing at the top of the range is 32 of 448: error <= amax / 28 per block
    w = named()[0][1]
    assert 0 < a["max_abs_err"] <= w.abs().max().item() / 28
    assert b["max_abs_err"] < a["max_abs_err"]   # errors are in the weight's units


def test_format_report():
    rows = quantization_report(named())
    text = format_report(rows)
    lines = text.splitlines()
    assert lines[0].startswith("| name | shape | rel_err")
    assert "130x200" in text and "2x128x64" in text
    assert "4 tensors:" in lines[-1] and "fp8" in lines[-1]
    body = [ln for ln in lines[2:] if ln.startswith("| ")]
    errs = [float(ln.split("|")[3]) for ln in body]
    assert errs == sorted(errs, reverse=True)   # worst first
    short = format_report(rows, max_rows=1)
    assert "3 more" in short
    assert format_report([]) == "no tensors quantised"

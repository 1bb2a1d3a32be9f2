"""Per-tensor FP8 quantisation error report and its text formatter.

Row fields:
- `name`, `shape`;
- `rel_err`: ||w - deq(q(w))||_F / ||w||_F (0.0 for an all-zero tensor);
- `max_abs_err`: max |w - deq(q(w))|, in the weight's units;
- `bytes_bf16`: 2 bytes per element; `bytes_fp8`: 1 byte per element + 4 per block scale.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from rl.quant.block_fp8 import (
    DEFAULT_BLOCK, dequantize_weight_block, fp8_bytes, quantize_weight_block,
)


def error_row(name: str, w: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor,
              block: int = DEFAULT_BLOCK) -> dict:
    """One report row from a weight and its already computed quantisation."""
    w32 = w.detach().float()
    diff = dequantize_weight_block(w8, scale, block, torch.float32) - w32
    norm = w32.norm().item()
    return {
        "name": name,
        "shape": tuple(w.shape),
        "rel_err": diff.norm().item() / norm if norm > 0 else 0.0,
        "max_abs_err": diff.abs().max().item() if diff.numel() else 0.0,
        "bytes_bf16": 2 * w.numel(),
        "bytes_fp8": fp8_bytes(tuple(w.shape), block),
    }


@torch.no_grad()
def quantization_report(named_weights: Iterable[tuple[str, torch.Tensor]],
                        block: int = DEFAULT_BLOCK, pow2: bool = False) -> list[dict]:
    """Quantise each (name, weight) of shape (N, K) or (E, N, K) and measure the error.

    The caller chooses which weights to pass (e.g. filtered by `policy.should_quantize`).
    """
    rows = []
    for name, w in named_weights:
        w8, scale = quantize_weight_block(w.detach(), block, pow2)
        rows.append(error_row(name, w, w8, scale, block))
    return rows


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def format_report(rows: list[dict], max_rows: int | None = 50) -> str:
    """A markdown table (worst relative error first) plus a totals line."""
    if not rows:
        return "no tensors quantised"
    ordered = sorted(rows, key=lambda r: r["rel_err"], reverse=True)
    shown = ordered if max_rows is None else ordered[:max_rows]
    lines = ["| name | shape | rel_err | max_abs_err | MiB bf16 | MiB fp8 |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in shown:
        shape = "x".join(str(s) for s in r["shape"])
        lines.append(f"| {r['name']} | {shape} | {r['rel_err']:.4f} | {r['max_abs_err']:.3g} "
                     f"| {_mib(r['bytes_bf16'])} | {_mib(r['bytes_fp8'])} |")
    if len(shown) < len(ordered):
        lines.append(f"| ... {len(ordered) - len(shown)} more | | | | | |")
    bf16 = sum(r["bytes_bf16"] for r in rows)
    fp8 = sum(r["bytes_fp8"] for r in rows)
    worst = ordered[0]
    lines.append("")
    lines.append(f"{len(rows)} tensors: {_mib(bf16)} MiB bf16 -> {_mib(fp8)} MiB fp8 "
                 f"({fp8 / bf16:.3f}x); worst rel_err {worst['rel_err']:.4f} ({worst['name']})")
    return "\n".join(lines)

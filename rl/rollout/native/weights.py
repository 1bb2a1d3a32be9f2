"""Weights of the `native` engine: fused linear slots (BF16 or block FP8) and the name map.

The engine fuses what one decode GEMM can do at once: `qkv` = [q; k; v] rows, `gate_up` =
[gate; up] rows (HF's own fused expert layout, `experts.gate_up_proj` (E, 2I, H), is kept as is).
Incoming tensors arrive by HF in-memory name (`...q_proj.weight`, `...experts.gate_up_proj`) or
by checkpoint name (`...experts.3.gate_proj.weight`), as full-precision tensors or as FP8 wire
pairs `(e4m3 bytes, fp32 128x128 block scales)` (`rl.quant.wire`).

FP8 placement: a piece whose rows start on a 128-row block boundary and end on one (or at the
end of the slot) owns whole scale blocks, so it is written directly: wire FP8 bytes and scales
are copied as they are (no second rounding), full-precision pieces are quantised alone. A piece
that shares a 128-row band with its neighbour (e.g. k_proj with 64 rows) is buffered in fp32
until every row of that band has arrived; then the band is quantised once.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypeAlias

import torch

from rl.quant.block_fp8 import (
    DEFAULT_BLOCK, FP8_DTYPE, dequantize_weight_block, num_blocks, quantize_weight_block,
)
from rl.quant.fast_quant import quantize_weight_fast

Piece: TypeAlias = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""A full-precision (rows, K) tensor, or an FP8 pair (uint8/e4m3 (rows, K), scales)."""


class UnknownWeightError(KeyError):
    """A name the native engine has no slot for."""


class IncompleteWeightsError(ValueError):
    """Fused rows that share an FP8 block arrived without their neighbours."""


def _as_float(piece: Piece) -> torch.Tensor:
    if isinstance(piece, tuple):
        w, s = piece
        return dequantize_weight_block(w.view(FP8_DTYPE), s, DEFAULT_BLOCK, torch.float32)
    return piece


class LinearSlot:
    """One fused weight `(E?, N, K)`: BF16/fp32 in `w`, or e4m3 bytes in `w` (uint8) plus fp32
    block scales in `scale` (E?, ceil(N/128), ceil(K/128)). Updated in place (CUDA graphs keep
    pointers to these tensors)."""

    def __init__(self, shape: tuple[int, ...], fp8: bool, dtype: torch.dtype,
                 device: torch.device, pow2: bool = False):
        self.shape, self.fp8, self.pow2 = tuple(shape), fp8, pow2
        *lead, n, k = self.shape
        self.n, self.k = n, k
        if fp8:
            self.w = torch.zeros(self.shape, dtype=torch.uint8, device=device)
            self.scale = torch.ones(*lead, num_blocks(n, DEFAULT_BLOCK),
                                    num_blocks(k, DEFAULT_BLOCK), device=device)
        else:
            self.w = torch.zeros(self.shape, dtype=dtype, device=device)
            self.scale = None
        self._pending: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {}

    def _view(self, expert: int | None):
        if expert is None:
            return self.w, self.scale
        return self.w[expert], (None if self.scale is None else self.scale[expert])

    def set(self, expert: int | None, row0: int, piece: Piece) -> None:
        """Write rows [row0, row0 + rows) of expert `expert` (None: a 2-D slot, or all experts
        at once when the piece is 3-D)."""
        if expert is None and len(self.shape) == 3:
            vals = piece[0] if isinstance(piece, tuple) else piece
            if tuple(vals.shape) != self.shape:
                raise ValueError(f"expert stack: got {tuple(vals.shape)}, expected {self.shape}")
            if self.fp8 and isinstance(piece, tuple):   # whole stack: blocks line up
                self.w.copy_(piece[0].view(torch.uint8))
                self.scale.copy_(piece[1])
                return
            if self.fp8:
                quantize_weight_fast(piece.to(self.w.device), self.pow2, out=self.w,  # type: ignore[union-attr]  # lint baseline (issue 39)
                                     scale_out=self.scale)
                return
            for e in range(self.shape[0]):
                self.set(e, 0, (piece[0][e], piece[1][e]) if isinstance(piece, tuple) else piece[e])
            return
        w, s = self._view(expert)
        vals = piece[0] if isinstance(piece, tuple) else piece
        rows = vals.shape[0]
        if vals.dim() != 2 or vals.shape[1] != self.k or row0 + rows > self.n:
            raise ValueError(f"rows {row0}:{row0 + rows} x {tuple(vals.shape[1:])} do not fit a "
                             f"({self.n}, {self.k}) slot")
        if not self.fp8:
            w[row0:row0 + rows].copy_(_as_float(piece))
            return
        aligned = row0 % DEFAULT_BLOCK == 0 and (rows % DEFAULT_BLOCK == 0
                                                 or row0 + rows == self.n)
        if aligned:
            if isinstance(piece, tuple):
                w8, sc = piece[0].view(torch.uint8), piece[1]
                b0 = row0 // DEFAULT_BLOCK
                w[row0:row0 + rows].copy_(w8)
                s[b0:b0 + sc.shape[0]].copy_(sc)
            else:  # quantise on receive, straight into the slot (one Triton pass on GPU)
                b0 = row0 // DEFAULT_BLOCK
                quantize_weight_fast(piece.to(w.device), self.pow2, out=w[row0:row0 + rows],
                                     scale_out=s[b0:b0 + num_blocks(rows, DEFAULT_BLOCK)])
            return
        buf, seen = self._pending.get(expert) or (
            torch.zeros(self.n, self.k, dtype=torch.float32, device=w.device),
            torch.zeros(self.n, dtype=torch.bool, device="cpu"))
        buf[row0:row0 + rows].copy_(_as_float(piece))
        seen[row0:row0 + rows] = True
        # Flush every 128-row band this piece touched once all of its rows have arrived.
        for band in range(row0 // DEFAULT_BLOCK, -(-(row0 + rows) // DEFAULT_BLOCK)):
            lo, hi = band * DEFAULT_BLOCK, min((band + 1) * DEFAULT_BLOCK, self.n)
            if bool(seen[lo:hi].all()):
                q8, sc = quantize_weight_block(buf[lo:hi], DEFAULT_BLOCK, self.pow2)
                w[lo:hi].copy_(q8.view(torch.uint8))
                s[band].copy_(sc[0])
                seen[lo:hi] = False
        if bool(seen.any()):
            self._pending[expert] = (buf, seen)
        else:
            self._pending.pop(expert, None)

    def pending(self) -> list[int | None]:
        return list(self._pending)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as `dtype` (a copy for FP8 slots; the tensor itself otherwise)."""
        if not self.fp8:
            return self.w if self.w.dtype == dtype else self.w.to(dtype)
        return dequantize_weight_block(self.w.view(FP8_DTYPE), self.scale, DEFAULT_BLOCK, dtype)

    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size() + (
            0 if self.scale is None else self.scale.numel() * 4)


@dataclass(frozen=True, slots=True)
class Target:
    """Where a named tensor goes: a linear slot (rows from `row0`, expert or None) or a plain
    tensor (norms, embeddings, router), by key into the model's tensor dicts."""
    key: str
    linear: bool
    row0: int = 0
    expert: int | None = None


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def resolve_name(name: str, nh: int, nkv: int, head_dim: int, dense_inter: int, moe_inter: int,
                 is_moe: list[bool], tied: bool) -> Target:
    """Map an HF in-memory or checkpoint name to its `Target`; raises UnknownWeightError."""
    if name == "model.embed_tokens.weight":
        return Target("embed", False)
    if name == "lm_head.weight":
        return Target("embed" if tied else "lm_head", False)
    if name == "model.norm.weight":
        return Target("final_norm", False)
    m = _LAYER.match(name)
    if m is None or int(m.group(1)) >= len(is_moe):
        raise UnknownWeightError(name)
    i, rest = int(m.group(1)), m.group(2)
    p = f"layers.{i}."
    q_rows, kv_rows = nh * head_dim, nkv * head_dim
    simple = {
        "self_attn.q_proj.weight": (p + "qkv", 0), "self_attn.k_proj.weight": (p + "qkv", q_rows),
        "self_attn.v_proj.weight": (p + "qkv", q_rows + kv_rows),
        "self_attn.o_proj.weight": (p + "o", 0),
    }
    if not is_moe[i]:
        simple.update({"mlp.gate_proj.weight": (p + "gate_up", 0),
                       "mlp.up_proj.weight": (p + "gate_up", dense_inter),
                       "mlp.down_proj.weight": (p + "down", 0)})
    if rest in simple:
        key, row0 = simple[rest]
        return Target(key, True, row0)
    plain = {"input_layernorm.weight": "ln1", "post_attention_layernorm.weight": "ln2",
             "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"}
    if rest in plain:
        return Target(p + plain[rest], False)
    if is_moe[i]:
        if rest == "mlp.gate.weight":
            return Target(p + "router", False)
        if rest == "mlp.experts.gate_up_proj":
            return Target(p + "experts_gate_up", True)
        if rest == "mlp.experts.down_proj":
            return Target(p + "experts_down", True)
        e = _EXPERT.match(rest)
        if e is not None:
            kind = e.group(2)
            key = p + ("experts_down" if kind == "down_proj" else "experts_gate_up")
            return Target(key, True, moe_inter if kind == "up_proj" else 0, int(e.group(1)))
    raise UnknownWeightError(name)

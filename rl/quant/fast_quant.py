"""One-pass FP8 quantisers (Triton): block-FP8 weights for the weight sync, 1x128 activations
for the block-scaled GEMM (`quantize_act_fast`, read by `backends._linear_cuda` and the native
engine's fused RMSNorm / SiLU kernels).

Weights:

`quantize_weight_block` (the torch reference in `block_fp8`) runs ~8 full-size fp32 passes;
this kernel reads each 128x128 tile once (2 bytes/element for bf16) and writes the e4m3 byte and
one scale per tile, which is what lets quantise-on-send keep up with NCCL (a sync that quantises
slower than the link moves bytes loses FP8's halved wire size).

Same conventions as `block_fp8.quantize_weight_block` (scale = amax / 448, zero tile -> 1.0,
optional power-of-two scales, x / scale rounded to nearest e4m3); the GPU test checks the bytes
against the reference. Falls back to the reference off CUDA or without Triton.

Activations: one scale (amax / 448) per row and 128 columns, DeepSeek's 1x128 groups
(`block_fp8.quantize_act_group`), the scales column-major (strides (1, M)), the layout cuBLAS's
block-scaled GEMM reads them in, and rows optionally padded with zeros to a multiple (cuBLAS
wants M % 4 == 0). `QuantAct` carries the three together so a producer kernel that already
quantised its output (RMSNorm, SiLU) hands it straight to the GEMM.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from rl.quant.block_fp8 import (DEFAULT_BLOCK, FP8_DTYPE, FP8_MAX, num_blocks,
                                quantize_act_group, quantize_weight_block)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


class QuantAct(NamedTuple):
    """Activations quantised for the block-scaled GEMM: `q` e4m3 (M', K), `scale` fp32 (M', G)
    column-major, `rows` = M, the real rows (M' >= M: zero rows of padding, cut off after)."""
    q: torch.Tensor
    scale: torch.Tensor
    rows: int


if triton is not None:
    # The Triton interpreter (CPU tests) casts fp32 -> e4m3 by truncating, dropping carries;
    # under it the kernels round first (`e4m3_round`, what the hardware cast does), so both
    # compute one function.
    INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

    @triton.jit
    def e4m3_round(y):
        """y (fp32, |y| <= 448) rounded to nearest-even on e4m3's 3 mantissa bits in the normal
        range, so the cast after it is exact (the interpreter's cast drops carries); e4m3
        subnormals (|y| < 2**-6) are left to the cast."""
        bits = y.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576   # clear 20 low mantissa bits
        return tl.where(tl.abs(y) >= 0.015625, bits.to(tl.float32, bitcast=True), y)

    @triton.jit
    def to_e4m3(x, EXACT: tl.constexpr):
        """fp32 (|x| <= 448) -> e4m3, round to nearest even (EXACT: under the interpreter)."""
        if EXACT:
            x = e4m3_round(x)
        return x.to(tl.float8e4nv)

    @triton.jit
    def quant_blocks(y, AXIS: tl.constexpr, EXACT: tl.constexpr):
        """y (fp32, 2-D) whose 128-wide blocks run along AXIS -> (their e4m3 bytes as uint8,
        one scale amax / 448 per block): the activation quantiser's one formula, used by every
        kernel that writes a `QuantAct`."""
        scale = tl.maximum(tl.max(tl.abs(y), axis=AXIS), 1e-12) * (1.0 / 448.0)
        q = to_e4m3(tl.minimum(tl.maximum(y / tl.expand_dims(scale, AXIS), -448.0), 448.0),
                    EXACT)
        return q.to(tl.uint8, bitcast=True), scale

    @triton.jit
    def store_act_blocks(x, q_ptr, s_ptr, row, K, n, M_PAD, NBP: tl.constexpr,
                         EXACT: tl.constexpr):
        """NBP * 128 fp32 values of row `row` (zero past the first n) as 1x128 e4m3 blocks into
        q_ptr + row * K (a row of q (M', K)), and their scales into column `row` of s (G, M')
        (M' = M_PAD). A kernel covering part of a row passes pointers and n from its start."""
        q, scale = quant_blocks(tl.reshape(x, (NBP, 128)), 1, EXACT)
        blk = tl.arange(0, NBP)
        cols = blk[:, None] * 128 + tl.arange(0, 128)[None, :]
        tl.store(q_ptr + row * K + cols, q, mask=cols < n)
        tl.store(s_ptr + blk * M_PAD + row, scale, mask=blk * 128 < n)

    @triton.jit
    def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, M_PAD, NBP: tl.constexpr,
                          EXACT: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, NBP * 128)
        x = tl.load(x_ptr + row * K + cols, mask=cols < tl.where(row < M, K, 0), other=0.0)
        store_act_blocks(x.to(tl.float32), q_ptr, s_ptr, row, K, K, M_PAD, NBP, EXACT)

    @triton.jit
    def _quant_kernel(w_ptr, q_ptr, s_ptr, N, K, NB, KB, fp8_max,
                      POW2: tl.constexpr, BLOCK: tl.constexpr):
        e = tl.program_id(0).to(tl.int64)
        nb = tl.program_id(1)
        kb = tl.program_id(2)
        rn = nb * BLOCK + tl.arange(0, BLOCK)
        rk = kb * BLOCK + tl.arange(0, BLOCK)
        mask = (rn[:, None] < N) & (rk[None, :] < K)
        offs = e * N * K + rn[:, None].to(tl.int64) * K + rk[None, :]
        x = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        # div_rn: IEEE division. Triton's `/` on fp32 may lower to an approximate division,
        # and the scale and bytes must equal the torch reference's bit for bit on any device.
        scale = tl.where(amax > 0, tl.div_rn(amax, fp8_max), 1.0)
        if POW2:
            scale = tl.exp2(tl.ceil(tl.log2(scale)))
        y = tl.minimum(tl.maximum(tl.div_rn(x, scale), -fp8_max), fp8_max)
        tl.store(q_ptr + offs, y.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=mask)
        tl.store(s_ptr + e * NB * KB + nb * KB + kb, scale)


def quantize_weight_fast(w: torch.Tensor, pow2: bool = False, out: torch.Tensor | None = None,
                         scale_out: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Like `quantize_weight_block(w, 128, pow2)`, but returns the e4m3 values as uint8 bytes
    (the wire format). `w` (N, K) or (E, N, K) float, any device. `out` / `scale_out`:
    contiguous destinations to write into (e.g. views of a sync bucket), else new tensors."""
    if triton is None or not w.is_cuda:
        q8, scale = quantize_weight_block(w, DEFAULT_BLOCK, pow2)
        q8 = q8.view(torch.uint8)
        if out is not None:
            q8 = out.copy_(q8)
        if scale_out is not None:
            scale = scale_out.copy_(scale)
        return q8, scale
    return _quantize_triton(w, pow2, out, scale_out)


def _quantize_triton(w: torch.Tensor, pow2: bool, out: torch.Tensor | None = None,
                     scale_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.contiguous()
    *lead, n, k = w.shape
    e = lead[0] if lead else 1
    nb, kb = num_blocks(n, DEFAULT_BLOCK), num_blocks(k, DEFAULT_BLOCK)
    q = out if out is not None else torch.empty(w.shape, dtype=torch.uint8, device=w.device)
    scale = scale_out if scale_out is not None else torch.empty(
        *lead, nb, kb, dtype=torch.float32, device=w.device)
    _quant_kernel[(e, nb, kb)](w, q, scale, n, k, nb, kb, FP8_MAX, POW2=pow2, BLOCK=DEFAULT_BLOCK)
    return q, scale


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def act_buffers(m: int, k: int, device: torch.device, rows_multiple: int = 1
                ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Uninitialised (q uint8 (M', K), s fp32 (G, M'), M') for a kernel that quantises M rows
    of width K (M' = M rounded up to `rows_multiple`)."""
    m_pad = -(-m // rows_multiple) * rows_multiple
    return (torch.empty(m_pad, k, dtype=torch.uint8, device=device),
            torch.empty(num_blocks(k, DEFAULT_BLOCK), m_pad, dtype=torch.float32, device=device),
            m_pad)


def quantize_act_fast(x: torch.Tensor, rows_multiple: int = 1, impl: str = "auto") -> QuantAct:
    """x (M, K) -> `QuantAct`: `quantize_act_group(x)` in one pass, scales column-major, rows
    padded with zeros to a multiple of `rows_multiple`. `impl`: "auto" (Triton on CUDA, else the
    torch reference), "triton" (also CPU tensors under TRITON_INTERPRET), "torch"."""
    m, k = x.shape
    if impl == "auto":
        impl = "triton" if triton is not None and x.is_cuda else "torch"
    if impl == "torch":
        m_pad = -(-m // rows_multiple) * rows_multiple
        x8, sc = quantize_act_group(x if m_pad == m else
                                    torch.nn.functional.pad(x, (0, 0, 0, m_pad - m)))
        return QuantAct(x8, sc.t().contiguous().t(), m)
    q, sc, m_pad = act_buffers(m, k, x.device, rows_multiple)
    nbp = _next_pow2(num_blocks(k, DEFAULT_BLOCK))
    _act_quant_kernel[(m_pad,)](x.contiguous(), q, sc, m, k, m_pad, NBP=nbp, EXACT=INTERPRETED)
    return QuantAct(q.view(FP8_DTYPE), sc.t(), m)

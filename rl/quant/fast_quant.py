"""Block-FP8 weight quantisation in one pass over the weight (Triton), for the weight sync.

`quantize_weight_block` (the torch reference in `block_fp8`) runs ~8 full-size fp32 passes;
this kernel reads each 128x128 tile once (2 bytes/element for bf16) and writes the e4m3 byte and
one scale per tile, which is what lets quantise-on-send keep up with NCCL (a sync that quantises
slower than the link moves bytes loses FP8's halved wire size).

Same conventions as `block_fp8.quantize_weight_block` (scale = amax / 448, zero tile -> 1.0,
optional power-of-two scales, x / scale rounded to nearest e4m3); the GPU test checks the bytes
against the reference. Falls back to the reference off CUDA or without Triton.
"""
from __future__ import annotations

import torch

from rl.quant.block_fp8 import DEFAULT_BLOCK, FP8_MAX, num_blocks, quantize_weight_block

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


if triton is not None:
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


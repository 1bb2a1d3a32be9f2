"""Decode kernels of the `native` engine: Triton on GPU, a torch reference for CPU and tests.

Every op has `impl="triton" | "torch"`; both compute the same function (fp32 math inside, output
in the activation dtype). The Triton versions exist to cut kernel count and bytes per decode step
(one fused launch where eager torch needs five to ten), which is what decides decode speed for
small models once CUDA graphs remove the Python overhead.

Ops (shapes: B rows, NH query heads, NKV kv heads, D head dim, L cache length):
- `rmsnorm(x (M, H), w (H,), eps, residual=None)`: with `residual`, first `h = x + residual`
  (rounded to x's dtype, as HF adds in the model dtype), returns `(norm(h) * w, h)`; x may be
  a split-K GEMM's unsummed `Partials` (o / down at decode), summed on the way in.
- `qk_norm_rope_cache(qkv (B, (NH+2NKV)*D), ...)`: per-head RMSNorm of q and k, rotary embedding
  at position `pos - start[b]`, q out as (B, NH, D); k and v written into the caches at slot `pos`
  (FP8 caches: quantised on write, see `rl.rollout.native.kvcache`). `qk_norm_rope_prefill`:
  the same norm and rotary over every slot of a left-padded prefill, q / k / v out in
  attention layout (B, heads, P, D).
- `decode_attention(q (B, NH, D), k_cache, v_cache (B, NKV, L, D), start (B,), pos (1,))`: one
  query per row over cache slots [start[b], pos]; online softmax in fp32. FP8 caches are read
  as bytes, V transposed (B, NKV, D, L); their per-token scales multiply the scores and softmax
  weights. `splits` > 1: split-K (flash-decoding), each (row, kv head)'s context split over that
  many programs whose fp32 partials a second kernel combines; `decode_splits` picks the count
  from batch and context.
- `silu_mul(x (M, 2I))`: `silu(x[:, :I]) * x[:, I:]`.
- `w8a16_linear(x (M, K), w (N, K), scale)`: `x @ deq(w).T` with block-FP8 weights (uint8 view of
  e4m3, fp32 128x128 block scales) dequantised in registers: the weight crosses HBM as 1 byte.
- `grouped_linear(x (R, K), w (E, N, K), scale, offs (E+1,))`: rows offs[e]:offs[e+1] of x (sorted
  by expert) times expert e's weight; FP8 (with scales) or plain BF16 weights.
- `w8a8_linear(x (M, K), w (N, K), scale)`: x quantised to e4m3 in 1x128 blocks times the
  block-FP8 weight on the tensor cores (`rl.quant.backends.block_scaled_mm`: cuBLAS, 1x128 x
  128x128 block scales; Hopper, CUDA 12.9+), or with gemm="triton" in our TMA-fed kernel
  (`w8a8_triton`, split-K for narrow outputs). `rmsnorm` and `silu_mul` with `quant=True` emit
  its input already quantised (`rl.quant.fast_quant.QuantAct`): no separate quantiser launch.
- `sample_temperature(logits (B, V), temperature, seed)`: one token per row from
  softmax(logits / T) by inverse CDF over vocabulary tiles, and its temperature-1 log-prob,
  reading the logits once (a tile pass, then one program per row).

The Triton interpreter (TRITON_INTERPRET=1) runs these on CPU tensors for the unit tests, with
fp16 activations: it mishandles bf16 dots (numpy has no bf16). On GPU they run in bf16.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from rl.quant.backends import block_scaled_mm, cuda_unavailable_reason, fp8_linear
from rl.quant.block_fp8 import DEFAULT_BLOCK, dequantize_act_group, dequantize_weight_block
from rl.quant.fast_quant import QuantAct, act_buffers, quantize_act_fast
from rl.rollout.native.kvcache import dequantize_kv, quantize_kv

try:  # Triton is optional: the CPU engine never needs it
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor   # triton >= 3.4
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None


def triton_available() -> bool:
    return triton is not None


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


# ======================================================================================
# torch references
# ======================================================================================
def _rmsnorm_torch(x, w, eps, residual=None):
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    h32 = h.float()
    y = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps) * w.float()
    return y.to(x.dtype), h


def _rope_torch(x, cos, sin):
    """x (..., D) fp32, cos/sin (..., D/2) fp32: HF's rotate_half convention."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _qk_torch(qkv, qn_w, kn_w, cos, sin, start, pos, k_cache, v_cache, nh, nkv, eps,
              k_exp=None, v_exp=None):
    b = qkv.shape[0]
    d = qn_w.shape[0]
    p = int(pos.reshape(-1)[0])
    heads = qkv.float().view(b, nh + 2 * nkv, d)
    q, k, v = heads[:, :nh], heads[:, nh:nh + nkv], heads[:, nh + nkv:]
    position = (p - start.long()).clamp(min=0)
    c, s = cos[position][:, None], sin[position][:, None]
    q = _rope_torch(_rmsnorm_torch(q, qn_w, eps)[0], c, s)
    k = _rope_torch(_rmsnorm_torch(k, kn_w, eps)[0], c, s)
    if k_exp is None:
        k_cache[:b, :, p] = k.to(k_cache.dtype)
        v_cache[:b, :, p] = v.to(v_cache.dtype)
    else:
        k8, ke = quantize_kv(k)
        v8, ve = quantize_kv(v)
        k_cache[:b, :, p] = k8.view(k_cache.dtype)
        v_cache[:b, :, :, p] = v8.view(v_cache.dtype)        # FP8 V is stored (D, L)
        k_exp[:b, :, p], v_exp[:b, :, p] = ke, ve
    return q.to(qkv.dtype)


def _attention_torch(q, k_cache, v_cache, start, pos, sm_scale, k_exp=None, v_exp=None):
    b, nh, d = q.shape
    nkv = k_cache.shape[1]
    end = int(pos.reshape(-1)[0]) + 1
    if k_exp is None:
        k, v = k_cache[:b, :, :end].float(), v_cache[:b, :, :end].float()
    else:
        k = dequantize_kv(k_cache[:b, :, :end], k_exp[:b, :, :end])
        v = dequantize_kv(v_cache[:b, :, :, :end].transpose(-1, -2), v_exp[:b, :, :end])
    qg = q.float().view(b, nkv, nh // nkv, d)
    scores = torch.einsum("bhgd,bhld->bhgl", qg, k) * sm_scale
    slots = torch.arange(end, device=q.device)
    valid = slots[None, :] >= start.long()[:, None]                         # (B, L)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgl,bhld->bhgd", scores.softmax(-1), v)
    return out.reshape(b, nh, d).to(q.dtype)


def _grouped_torch(x, w, scale, offs):
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
    bounds = offs.tolist()
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            we = w[e].float() if scale is None else dequantize_weight_block(
                w[e].view(torch.float8_e4m3fn), scale[e], DEFAULT_BLOCK, torch.float32)
            out[lo:hi] = x[lo:hi].float() @ we.t()
    return out.to(x.dtype)


# ======================================================================================
# Triton kernels
# ======================================================================================
if triton is not None:
    from rl.quant.fast_quant import INTERPRETED as _INTERPRETED
    from rl.quant.fast_quant import quant_blocks, store_act_blocks, to_e4m3 as _to_e4m3
    from rl.rollout.native.kvcache import store_kv

    @triton.jit
    def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, s_ptr, M, H, M_PAD, eps, splits,
                        HAS_RES: tl.constexpr, QUANT: tl.constexpr, PARTS: tl.constexpr,
                        BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, EXACT: tl.constexpr):
        """Row `row`: h = x (+ res) (stored when HAS_RES or PARTS), y = norm(h) * w in h's
        dtype; QUANT: y as 1x128 e4m3 blocks into y_ptr (uint8 (M_PAD, H)) and their scales
        into s_ptr (column-major), rows M..M_PAD zeros (the GEMM's padding). PARTS: x is a
        split-K GEMM's fp32 partials (splits, M, H), summed here and rounded to h's dtype (as
        the GEMM's own reduction would round its output; one load of all BLOCK_S >= splits
        partials, so they are read in parallel)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        mask = cols < tl.where(row < M, H, 0)        # padding rows read as zeros
        if PARTS:
            part = tl.arange(0, BLOCK_S)
            xs = tl.load(x_ptr + (part[:, None] * M + row) * H + cols[None, :],
                         mask=(part[:, None] < splits) & mask[None, :], other=0.0)
            x = tl.sum(xs, axis=0).to(h_ptr.dtype.element_ty)
            if not HAS_RES:
                tl.store(h_ptr + row * H + cols, x, mask=mask)
        else:
            x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * H + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(h_ptr + row * H + cols, x, mask=mask)
        h = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = (h * rstd * w).to(x.dtype)
        if QUANT:   # quantised from the rounded y, as the unfused path quantises the stored y
            store_act_blocks(y.to(tl.float32), y_ptr, s_ptr, row, H, H, M_PAD, BLOCK_H // 128,
                             EXACT)
        else:
            tl.store(y_ptr + row * H + cols, y, mask=mask)

    @triton.jit
    def _rows_norm_rope(x1, x2, w_ptr, c, s, eps, D: tl.constexpr, HALF: tl.constexpr):
        """Per-row RMSNorm (weight w) and rotary of a block of heads or tokens: x1, x2 (R, HALF)
        the halves of R rows, c, s their (R, HALF) cos / sin (or (1, HALF): one position)."""
        d = tl.arange(0, HALF)
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)
        x1 = x1 * rstd[:, None] * tl.load(w_ptr + d).to(tl.float32)[None, :]
        x2 = x2 * rstd[:, None] * tl.load(w_ptr + HALF + d).to(tl.float32)[None, :]
        return x1 * c - x2 * s, x2 * c + x1 * s

    @triton.jit
    def _qk_rope_cache_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, start_ptr, pos_ptr,
                              q_ptr, kc_ptr, vc_ptr, ke_ptr, ve_ptr, eps, stride_qkv, stride_cb,
                              stride_ch, stride_vd, stride_eb, stride_eh, NH: tl.constexpr,
                              NKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                              HB: tl.constexpr, FP8_KV: tl.constexpr):
        """Row b, heads [j HB, (j + 1) HB) of its NH + 2 NKV as one (HB, D) tile (HB divides NH
        and NKV, so a program's heads are all q, all k or all v): q and k RMSNormed per head and
        rotated at position pos - start[b]; q into q_ptr, k and v into slot pos of the caches.
        (One program per head, 64-element vectors in 4 warps, took 6.6 us at 256 rows against
        2.4 us for 8 heads per program; FP8 13.4 vs 9.3 us, H200.)"""
        b = tl.program_id(0).to(tl.int64)  # b x cache stride can pass 2^31 for big caches
        h0 = tl.program_id(1) * HB
        hh = tl.arange(0, HB)
        d = tl.arange(0, HALF)
        pos = tl.load(pos_ptr)
        position = tl.maximum(pos - tl.load(start_ptr + b), 0)
        src = qkv_ptr + b * stride_qkv + (h0 + hh)[:, None] * D + d[None, :]
        x1 = tl.load(src).to(tl.float32)
        x2 = tl.load(src + HALF).to(tl.float32)
        c = tl.load(cos_ptr + position * HALF + d)[None, :]
        s = tl.load(sin_ptr + position * HALF + d)[None, :]
        if h0 < NH:
            y1, y2 = _rows_norm_rope(x1, x2, qn_ptr, c, s, eps, D, HALF)
            q_dst = q_ptr + (b * NH + h0 + hh)[:, None] * D + d[None, :]
            tl.store(q_dst, y1.to(q_ptr.dtype.element_ty))
            tl.store(q_dst + HALF, y2.to(q_ptr.dtype.element_ty))
        elif h0 < NH + NKV:
            y1, y2 = _rows_norm_rope(x1, x2, kn_ptr, c, s, eps, D, HALF)
            hk = h0 - NH + hh
            store_kv(kc_ptr + b * stride_cb + hk[:, None] * stride_ch + pos * D,
                     ke_ptr + b * stride_eb + hk * stride_eh + pos, y1, y2, HALF, FP8_KV)
        elif FP8_KV:  # V^T: the token is column `pos` of each head's (D, L) tile
            hv = h0 - NH - NKV + hh
            store_kv(vc_ptr + b * stride_cb + hv[:, None] * stride_ch + pos,
                     ve_ptr + b * stride_eb + hv * stride_eh + pos, x1, x2, HALF, FP8_KV,
                     stride_vd)
        else:
            hv = h0 - NH - NKV + hh
            store_kv(vc_ptr + b * stride_cb + hv[:, None] * stride_ch + pos * D, ve_ptr, x1, x2,
                     HALF, FP8_KV)

    @triton.jit
    def _qk_rope_prefill_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, start_ptr, q_ptr,
                                k_ptr, v_ptr, eps, T, P, NH: tl.constexpr, NKV: tl.constexpr,
                                D: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr):
        """Tokens t = b * P + j of a left-padded prefill (BLOCK_T of them), one head: q / k
        RMSNorm + rotary at position max(j - start[b], 0), v as it is, each into its
        (B, heads, P, D) output."""
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        h = tl.program_id(1)
        live = t < T
        b = t // P
        j = t - b * P
        d = tl.arange(0, HALF)
        position = tl.maximum(j - tl.load(start_ptr + b, mask=live, other=0), 0)
        rows = live[:, None] & (d[None, :] < HALF)
        src = qkv_ptr + t[:, None] * ((NH + 2 * NKV) * D) + h * D + d[None, :]
        x1 = tl.load(src, mask=rows, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=rows, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + position[:, None] * HALF + d[None, :], mask=rows, other=0.0)
        s = tl.load(sin_ptr + position[:, None] * HALF + d[None, :], mask=rows, other=0.0)
        if h < NH:
            y1, y2 = _rows_norm_rope(x1, x2, qn_ptr, c, s, eps, D, HALF)
            dst = q_ptr + ((b * NH + h) * P + j)[:, None] * D + d[None, :]
        elif h < NH + NKV:
            y1, y2 = _rows_norm_rope(x1, x2, kn_ptr, c, s, eps, D, HALF)
            dst = k_ptr + ((b * NKV + h - NH) * P + j)[:, None] * D + d[None, :]
        else:
            y1, y2 = x1, x2
            dst = v_ptr + ((b * NKV + h - NH - NKV) * P + j)[:, None] * D + d[None, :]
        out_ty = q_ptr.dtype.element_ty
        tl.store(dst, y1.to(out_ty), mask=rows)
        tl.store(dst + HALF, y2.to(out_ty), mask=rows)

    @triton.jit
    def _attn_blocks(q, kc_ptr, vc_ptr, base, start, end, lo, hi, sm_scale, GP: tl.constexpr,
                     D: tl.constexpr, BLOCK_L: tl.constexpr):
        """Online softmax of q (GP, D) over cache slots [max(lo, start), min(hi, end)) walked in
        BLOCK_L blocks from lo (a block boundary): (running max m, sum l, unnormalised acc), fp32.
        An empty range returns (-inf, 0, 0): the split combine weighs it 0. BF16 / FP16 caches."""
        d = tl.arange(0, D)
        m = tl.full((GP,), float("-inf"), tl.float32)
        l_sum = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, D), tl.float32)
        # Every block visited holds at least one valid slot, so m never stays -inf.
        for l0 in range(lo, hi, BLOCK_L):
            slots = l0 + tl.arange(0, BLOCK_L)
            valid = (slots >= start) & (slots < end)
            offs = base + slots[:, None] * D + d[None, :]
            k = tl.load(kc_ptr + offs, mask=valid[:, None], other=0)
            v = tl.load(vc_ptr + offs, mask=valid[:, None], other=0)
            s = tl.dot(q, tl.trans(k)) * sm_scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        return m, l_sum, acc

    @triton.jit
    def _kv_scales(e_ptr, mask):
        """Biased scale exponents (uint8) -> fp32 2**(e - 127) from the bits; 0 where masked."""
        return (tl.load(e_ptr, mask=mask, other=0).to(tl.int32) << 23).to(tl.float32,
                                                                          bitcast=True)

    @triton.jit
    def _attn_blocks_fp8(qt, q_sc, kc_ptr, vc_ptr, ke_ptr, ve_ptr, base, e_base, stride_vd,
                         start, end, lo, hi, sm_scale, GP: tl.constexpr, D: tl.constexpr,
                         BLOCK_L: tl.constexpr, QK8: tl.constexpr, PV8: tl.constexpr,
                         EXACT: tl.constexpr, MASK16: tl.constexpr):
        """`_attn_blocks` over an FP8 cache, transposed: the tile's slots are the MMA's M side
        (128 of them fill Hopper's 64-row FP8 MMA, where the 2 query heads of a KV head would
        fill 2 of 16 rows), so s^T = K q^T and acc^T += V^T p^T. K (L, D) and V^T (D, L) are
        both K-contiguous for these products: their bytes go from HBM to the tensor cores with
        no conversion or byte-wise transposition.

        qt: q^T (D, GP), e4m3 with one scale per query head (QK8, scales q_sc) or fp16.
        PV8: the softmax weights times V's token scales in e4m3, per query head scaled so the
        largest is 256 (e4m3 keeps 3 mantissa bits down to 2**-14 of it); else fp16 and V
        converted. Tiles are loaded unmasked (the cache is zeroed at allocation and its writer
        stores finite bytes only, the cache length is a multiple of BLOCK_L), or with MASK16
        only up to `hi` rounded up to 16 slots (the mask's 16-slot steps keep V^T's loads
        16-byte vectors): a partial last tile costs fewer HBM bytes. Masked slots get score
        -inf and weight 0. Returns (m, l, acc^T (D, GP))."""
        d = tl.arange(0, D)
        m = tl.full((GP,), float("-inf"), tl.float32)
        l_sum = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((D, GP), tl.float32)
        # The scale bytes (one per slot: too small for Triton's async copies) are loaded one
        # tile ahead, so their latency hides behind a tile's products.
        slots = lo + tl.arange(0, BLOCK_L)
        valid = (slots >= start) & (slots < end)
        k_sc = _kv_scales(ke_ptr + e_base + slots, valid)
        v_sc = _kv_scales(ve_ptr + e_base + slots, valid)
        for l0 in range(lo, hi, BLOCK_L):
            slots = l0 + tl.arange(0, BLOCK_L)
            valid = (slots >= start) & (slots < end)
            ahead = slots + BLOCK_L
            valid_ahead = (ahead >= start) & (ahead < end)
            k_sc_ahead = _kv_scales(ke_ptr + e_base + ahead, valid_ahead)
            v_sc_ahead = _kv_scales(ve_ptr + e_base + ahead, valid_ahead)
            if MASK16:
                live = slots < tl.multiple_of((hi + 15) // 16 * 16, 16)
                k = tl.load(kc_ptr + base + slots[:, None] * D + d[None, :], mask=live[:, None],
                            other=0)
                vt = tl.load(vc_ptr + base + d[:, None] * stride_vd + slots[None, :],
                             mask=live[None, :], other=0)
            else:
                k = tl.load(kc_ptr + base + slots[:, None] * D + d[None, :])
                vt = tl.load(vc_ptr + base + d[:, None] * stride_vd + slots[None, :])
            k = k.to(tl.float8e4nv, bitcast=True)
            vt = vt.to(tl.float8e4nv, bitcast=True)
            if QK8:
                st = tl.dot(k, qt) * q_sc[None, :]
            else:
                st = tl.dot(k.to(tl.float16), qt)
            st = tl.where(valid[:, None], st * (k_sc * sm_scale)[:, None], float("-inf"))
            m_new = tl.maximum(m, tl.max(st, axis=0))
            p = tl.exp(st - m_new[None, :])                        # (BLOCK_L, GP)
            alpha = tl.exp(m - m_new)
            l_sum = l_sum * alpha + tl.sum(p, axis=0)
            pv = p * v_sc[:, None]
            if PV8:
                c = tl.maximum(tl.max(pv, axis=0), 1e-30) * (1.0 / 256.0)
                part = tl.dot(vt, _to_e4m3(pv / c[None, :], EXACT)) * c[None, :]
            else:
                part = tl.dot(vt.to(tl.float16), pv.to(tl.float16))
            acc = acc * alpha[None, :] + part
            m = m_new
            k_sc, v_sc = k_sc_ahead, v_sc_ahead
        return m, l_sum, acc

    @triton.jit
    def _decode_attn_kernel(q_ptr, kc_ptr, vc_ptr, o_ptr, s_ptr, start_ptr, pos_ptr, sm_scale,
                            stride_cb, stride_ch, M_PAD, G: tl.constexpr, GP: tl.constexpr,
                            NH: tl.constexpr, D: tl.constexpr, BLOCK_L: tl.constexpr,
                            QUANT: tl.constexpr, EXACT: tl.constexpr):
        """BF16 cache, one (row, kv head). QUANT (D = 128): each query head's output, rounded to
        q's dtype, as one 1x128 e4m3 block of the o projection's W8A8 input (bytes into o_ptr,
        scale into column `b` of s_ptr (NH, M_PAD))."""
        b = tl.program_id(0).to(tl.int64)
        hk = tl.program_id(1)
        start = tl.load(start_ptr + b)
        end = tl.load(pos_ptr) + 1
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        q_rows = q_ptr + (b * NH + hk * G + g)[:, None] * D + d[None, :]
        q = tl.load(q_rows, mask=g[:, None] < G, other=0.0)
        m, l_sum, acc = _attn_blocks(q, kc_ptr, vc_ptr, b * stride_cb + hk * stride_ch, start,
                                     end, (start // BLOCK_L) * BLOCK_L, end, sm_scale, GP, D,
                                     BLOCK_L)
        out = (acc / l_sum[:, None]).to(q_ptr.dtype.element_ty)
        o_rows = o_ptr + (b * NH + hk * G + g)[:, None] * D + d[None, :]
        if QUANT:
            qb, sc = quant_blocks(out.to(tl.float32), 1, EXACT)
            tl.store(o_rows, qb, mask=g[:, None] < G)
            tl.store(s_ptr + (hk * G + g) * M_PAD + b, sc, mask=g < G)
        else:
            tl.store(o_rows, out, mask=g[:, None] < G)

    @triton.jit
    def _split_range(start, end, sid, S: tl.constexpr, BLOCK_L: tl.constexpr):
        """Slots [lo, hi) of split `sid` of S: the row's blocks [start // BLOCK_L, (end - 1) //
        BLOCK_L] dealt out evenly and contiguously (counts differ by at most one; splits past
        the block count get none)."""
        first = start // BLOCK_L
        blocks = (end - 1) // BLOCK_L + 1 - first
        lo = (first + sid * blocks // S) * BLOCK_L
        hi = tl.minimum((first + (sid + 1) * blocks // S) * BLOCK_L, end)
        return lo, hi

    @triton.jit
    def _decode_attn_split_kernel(q_ptr, kc_ptr, vc_ptr, m_ptr, l_ptr, acc_ptr, start_ptr,
                                  pos_ptr, sm_scale, stride_cb, stride_ch, S: tl.constexpr,
                                  G: tl.constexpr, GP: tl.constexpr, NH: tl.constexpr,
                                  D: tl.constexpr, BLOCK_L: tl.constexpr):
        """Split `sid` of S of one (row, kv head) (`_split_range`). Writes its partial (m, l,
        acc) in fp32."""
        b = tl.program_id(0).to(tl.int64)
        hk = tl.program_id(1)
        sid = tl.program_id(2)
        start = tl.load(start_ptr + b)
        end = tl.load(pos_ptr) + 1
        lo, hi = _split_range(start, end, sid, S, BLOCK_L)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        q_rows = q_ptr + (b * NH + hk * G + g)[:, None] * D + d[None, :]
        q = tl.load(q_rows, mask=g[:, None] < G, other=0.0)
        m, l_sum, acc = _attn_blocks(q, kc_ptr, vc_ptr, b * stride_cb + hk * stride_ch, start,
                                     end, lo, hi, sm_scale, GP, D, BLOCK_L)
        part = (b * NH + hk * G + g) * S + sid          # partials laid out (B, NH, S[, D])
        tl.store(m_ptr + part, m, mask=g < G)
        tl.store(l_ptr + part, l_sum, mask=g < G)
        tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=g[:, None] < G)

    @triton.jit
    def _decode_attn_fp8_kernel(q_ptr, kc_ptr, vc_ptr, ke_ptr, ve_ptr, o_ptr, m_ptr, l_ptr,
                                start_ptr, pos_ptr, sm_scale, stride_cb, stride_ch, stride_vd,
                                stride_eb, stride_eh, S: tl.constexpr, G: tl.constexpr,
                                GP: tl.constexpr, NH: tl.constexpr, D: tl.constexpr,
                                BLOCK_L: tl.constexpr, QK8: tl.constexpr, PV8: tl.constexpr,
                                EXACT: tl.constexpr, MASK16: tl.constexpr):
        """FP8 cache, one (row, kv head) (S = 1: out into o_ptr) or its split `sid` of S
        (partials m, l into m_ptr, l_ptr and acc into o_ptr, fp32, as the split kernel)."""
        b = tl.program_id(0).to(tl.int64)
        hk = tl.program_id(1)
        start = tl.load(start_ptr + b)
        end = tl.load(pos_ptr) + 1
        if S == 1:
            lo, hi = (start // BLOCK_L) * BLOCK_L, end
        else:
            lo, hi = _split_range(start, end, tl.program_id(2), S, BLOCK_L)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        rows = b * NH + hk * G + g
        qt = tl.load(q_ptr + rows[None, :] * D + d[:, None], mask=g[None, :] < G,
                     other=0.0).to(tl.float32)                             # q^T (D, GP)
        q_sc = tl.maximum(tl.max(tl.abs(qt), axis=0), 1e-30) * (1.0 / 448.0)
        if QK8:
            qt = _to_e4m3(qt / q_sc[None, :], EXACT)
        else:
            qt = qt.to(tl.float16)
        m, l_sum, acc = _attn_blocks_fp8(qt, q_sc, kc_ptr, vc_ptr, ke_ptr, ve_ptr,
                                         b * stride_cb + hk * stride_ch,
                                         b * stride_eb + hk * stride_eh, stride_vd, start, end,
                                         lo, hi, sm_scale, GP, D, BLOCK_L, QK8, PV8, EXACT,
                                         MASK16)
        if S == 1:
            out = acc / l_sum[None, :]
            tl.store(o_ptr + rows[None, :] * D + d[:, None], out.to(o_ptr.dtype.element_ty),
                     mask=g[None, :] < G)
        else:
            part = rows * S + tl.program_id(2)
            tl.store(m_ptr + part, m, mask=g < G)
            tl.store(l_ptr + part, l_sum, mask=g < G)
            tl.store(o_ptr + part[None, :] * D + d[:, None], acc, mask=g[None, :] < G)

    @triton.jit
    def _decode_attn_combine_kernel(m_ptr, l_ptr, acc_ptr, o_ptr, S: tl.constexpr,
                                    SP: tl.constexpr, D: tl.constexpr):
        """One (row, query head): out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, M the
        largest m_s (the log-sum-exp rule); empty splits (m_s = -inf) weigh 0."""
        bh = tl.program_id(0).to(tl.int64)
        sp = tl.arange(0, SP)
        d = tl.arange(0, D)
        m = tl.load(m_ptr + bh * S + sp, mask=sp < S, other=float("-inf"))
        l_sum = tl.load(l_ptr + bh * S + sp, mask=sp < S, other=0.0)
        acc = tl.load(acc_ptr + (bh * S + sp)[:, None] * D + d[None, :], mask=sp[:, None] < S,
                      other=0.0)
        w = tl.exp(m - tl.max(m, axis=0))      # the last split holds a valid slot: M is finite
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_sum * w, axis=0)
        tl.store(o_ptr + bh * D + d, out.to(o_ptr.dtype.element_ty))

    @triton.jit
    def _sample_tiles_kernel(x_ptr, m_ptr, s1_ptr, st_ptr, inv_t, V, stride, NT, tiles_per,
                             BLOCK: tl.constexpr, TEMP1: tl.constexpr):
        """Tiles [p * tiles_per, (p + 1) * tiles_per) of row `row`'s logits, BLOCK wide: each
        tile's max m, sum of exp(x - m) (temperature 1: the log-sum-exp) and sum of
        exp((x - m) / T) (the sampling mass; the same sum when TEMP1). One exp per logit (two at
        T != 1) and no noise: the logits are read once, at the memory's pace."""
        row = tl.program_id(0).to(tl.int64)
        t0 = tl.program_id(1) * tiles_per
        cols = tl.arange(0, BLOCK)
        xr = x_ptr + row * stride
        for t in range(t0, tl.minimum(t0 + tiles_per, NT)):
            c = t * BLOCK + cols
            x = tl.load(xr + c, mask=c < V, other=float("-inf")).to(tl.float32)
            m = tl.max(x, axis=0)
            d = x - tl.where(m == float("-inf"), 0.0, m)       # a tile all -inf: no NaN
            s1 = tl.sum(tl.exp(d), axis=0)
            tl.store(m_ptr + row * NT + t, m)
            tl.store(s1_ptr + row * NT + t, s1)
            if not TEMP1:
                tl.store(st_ptr + row * NT + t, tl.sum(tl.exp(d * inv_t), axis=0))

    @triton.jit
    def _sample_pick_kernel(x_ptr, seed_ptr, m_ptr, s1_ptr, st_ptr, tok_ptr, lp_ptr, inv_t, V,
                            stride, NT, NTP: tl.constexpr, BLOCK: tl.constexpr,
                            TEMP1: tl.constexpr):
        """Row `row`'s draw from softmax(x / T) by inverse CDF in two levels, two uniforms from
        Philox keyed by the step's seed + row: u1 picks a tile in proportion to its mass (the
        first whose running sum exceeds u1 x the total), u2 a logit in that tile in proportion to
        exp((x - m_tile) / T). A tile or logit of zero mass never passes the running sum's step,
        so -inf logits are never drawn. Also the temperature-1 log-prob x[tok] - lse."""
        row = tl.program_id(0).to(tl.int64)
        t = tl.arange(0, NTP)
        ok = t < NT
        m = tl.load(m_ptr + row * NT + t, mask=ok, other=float("-inf"))
        s1 = tl.load(s1_ptr + row * NT + t, mask=ok, other=0.0)
        mx = tl.max(m, axis=0)
        live = m != float("-inf")
        m_rel = tl.where(live, m - mx, 0.0)                # dead tiles weigh 0 through s1 = 0
        lse = mx + tl.log(tl.sum(s1 * tl.exp(m_rel), axis=0))
        if TEMP1:
            st = s1
        else:
            st = tl.load(st_ptr + row * NT + t, mask=ok, other=0.0)
        mass = st * tl.exp(m_rel * inv_t)
        run = tl.cumsum(mass, axis=0)
        u = tl.rand(tl.load(seed_ptr) + row, tl.arange(0, 2))
        u1 = tl.sum(tl.where(tl.arange(0, 2) == 0, u, 0.0), axis=0)
        u2 = tl.sum(tl.where(tl.arange(0, 2) == 1, u, 0.0), axis=0)
        # u < 1, yet u x total may round up to the total: never past the last tile (logit) with
        # mass.
        pick = tl.minimum(tl.sum((run <= u1 * tl.max(run, axis=0)).to(tl.int32), axis=0),
                          tl.max(tl.where(mass > 0, t, 0), axis=0))
        m_pick = tl.sum(tl.where(t == pick, m, 0.0), axis=0)
        c = pick * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride + c, mask=c < V, other=float("-inf")).to(tl.float32)
        e = tl.where(x == float("-inf"), 0.0, tl.exp((x - m_pick) * inv_t))
        run_x = tl.cumsum(e, axis=0)
        j = tl.minimum(tl.sum((run_x <= u2 * tl.max(run_x, axis=0)).to(tl.int32), axis=0),
                       tl.max(tl.where(e > 0, tl.arange(0, BLOCK), 0), axis=0))
        tok = pick * BLOCK + j
        tl.store(tok_ptr + row, tok.to(tl.int64))
        tl.store(lp_ptr + row, tl.load(x_ptr + row * stride + tok).to(tl.float32) - lse)

    @triton.jit
    def _silu_mul_kernel(x_ptr, y_ptr, s_ptr, M, I, M_PAD, BLOCK: tl.constexpr,  # noqa: E741
                         QUANT: tl.constexpr, EXACT: tl.constexpr):
        """Columns [c * BLOCK, (c + 1) * BLOCK) of row `row`; QUANT: as 1x128 e4m3 blocks
        (BLOCK a multiple of 128) with column-major scales, like `_rmsnorm_kernel`."""
        row = tl.program_id(0).to(tl.int64)
        c0 = tl.program_id(1) * BLOCK
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < tl.where(row < M, I, 0)
        gate = tl.load(x_ptr + row * 2 * I + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * 2 * I + I + cols, mask=mask, other=0.0).to(tl.float32)
        g = gate.to(tl.float32)
        y = (g / (1.0 + tl.exp(-g)) * up).to(gate.dtype)
        if QUANT:
            store_act_blocks(y.to(tl.float32), y_ptr + c0, s_ptr + c0 // 128 * M_PAD, row, I,
                             I - c0, M_PAD, BLOCK // 128, EXACT)
        else:
            tl.store(y_ptr + row * I + cols, y, mask=mask)

    @triton.jit
    def _mma_rows(x_ptr, w_ptr, s_ptr, rm, rn, row_end, N, K, stride_sn, k_lo, k_hi,
                  FP8: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """acc (BM, BN) = x[rm, k_lo:k_hi] @ deq(w[rn, k_lo:k_hi]).T; rows >= row_end and
        cols >= N read as 0."""
        acc = tl.zeros((BM, BN), tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            rk = k0 + tl.arange(0, BK)
            a = tl.load(x_ptr + rm[:, None] * K + rk[None, :],
                        mask=(rm[:, None] < row_end) & (rk[None, :] < K), other=0.0)
            w = tl.load(w_ptr + rn[:, None] * K + rk[None, :],
                        mask=(rn[:, None] < N) & (rk[None, :] < K), other=0)
            if FP8:
                w = w.to(tl.float8e4nv, bitcast=True)
                part = tl.dot(a, tl.trans(w.to(a.dtype)))
                # BK 64 or 128: one scale per (128-row block of N, the 128-wide K block).
                sc = tl.load(s_ptr + (rn // 128) * stride_sn + k0 // 128, mask=rn < N, other=0.0)
                acc += part * sc[None, :]
            else:
                acc += tl.dot(a, tl.trans(w.to(a.dtype)))
        return acc

    @triton.jit
    def _linear_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_sn, k_per_split,
                       FP8: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        ks = tl.program_id(2)  # split-K: partial sums land in y[ks] (fp32), summed outside
        k_lo = ks * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        acc = _mma_rows(x_ptr, w_ptr, s_ptr, rm, rn, M, N, K, stride_sn, k_lo, k_hi,
                        FP8, BM, BN, BK)
        tl.store(y_ptr + ks * M * N + rm[:, None] * N + rn[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _w8a8_kernel(a_desc, w_desc, sx_ptr, s_ptr, y_ptr, M, N, K, M_PAD, stride_sn,
                     k_per_split, BM: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr):
        """y[ks] (BM, BN) tile = sum over this split's 128-wide K blocks of
        (x8 @ w8.T) * sx[row, kb] * sw[n block, kb]: e4m3 x e4m3 products on the tensor cores
        (wgmma on Hopper), both operands brought in by TMA (`a_desc`: x8 (M_PAD, K) in BM x 128
        boxes, `w_desc`: w8 (N, K) in BN x 128 boxes; rows past either edge arrive as zeros) over
        a STAGES-deep pipeline; column-major activation scales sx (G, M_PAD), 128x128 weight
        block scales; split-K partials in fp32, summed outside."""
        off_m = tl.program_id(0) * BM
        off_n = tl.program_id(1) * BN
        ks = tl.program_id(2)
        rm = off_m + tl.arange(0, BM)
        rn = off_n + tl.arange(0, BN)
        k_lo = ks * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        acc = tl.zeros((BM, BN), tl.float32)
        for k0 in tl.range(k_lo, k_hi, 128, num_stages=STAGES):
            part = tl.dot(a_desc.load([off_m, k0]), w_desc.load([off_n, k0]).T)
            sa = tl.load(sx_ptr + (k0 // 128) * M_PAD + rm, mask=rm < M, other=0.0)
            if BN <= 128:        # a power of two: the tile lies in one 128-row weight block
                sb = tl.load(s_ptr + (off_n // 128) * stride_sn + k0 // 128)
                acc += part * (sa * sb)[:, None]
            else:
                sb = tl.load(s_ptr + (rn // 128) * stride_sn + k0 // 128, mask=rn < N, other=0.0)
                acc += part * sa[:, None] * sb[None, :]
        tl.store(y_ptr + ks * M * N + rm[:, None] * N + rn[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _grouped_kernel(x_ptr, w_ptr, s_ptr, y_ptr, offs_ptr, N, K, stride_we, stride_se,
                        stride_sn, FP8: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr):
        e = tl.program_id(0).to(tl.int64)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        row_start = tl.load(offs_ptr + e)
        row_end = tl.load(offs_ptr + e + 1)
        for m0 in range(row_start, row_end, BM):
            rm = m0 + tl.arange(0, BM)
            acc = _mma_rows(x_ptr, w_ptr + e * stride_we, s_ptr + e * stride_se, rm, rn, row_end,
                            N, K, stride_sn, 0, K, FP8, BM, BN, BK)
            tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=(rm[:, None] < row_end) & (rn[None, :] < N))


# ======================================================================================
# Public ops
# ======================================================================================
@dataclass(frozen=True, slots=True)
class Partials:
    """A split-K GEMM's output left unsummed: `parts` (splits, M, N) fp32, whose sum rounded to
    `dtype` is the product. `rmsnorm` takes it as its x and sums it on the way in, so the GEMMs
    that feed a residual add (o_proj, down_proj) spend no launches on their reduction."""
    parts: torch.Tensor
    dtype: torch.dtype

    def sum(self) -> torch.Tensor:
        return self.parts.sum(0).to(self.dtype)


def rmsnorm(x: torch.Tensor | Partials, w: torch.Tensor, eps: float,
            residual: torch.Tensor | None = None, impl: str = "torch", quant: bool = False
            ) -> tuple[torch.Tensor | QuantAct, torch.Tensor]:
    """(y, h): h = x (+ residual), y = rmsnorm(h) * w. x, residual (M, H) contiguous; x may be
    a split-K GEMM's `Partials`, summed in the same kernel. `quant`: y comes as the
    block-scaled GEMM's input (`QuantAct`, rows padded to 4), quantised in the same kernel (one
    launch and no bf16 round trip through memory)."""
    if impl == "torch":
        y, h = _rmsnorm_torch(x.sum() if isinstance(x, Partials) else x, w, eps, residual)
        return (quantize_act_fast(y, 4, "torch") if quant else y), h
    parts = isinstance(x, Partials)
    xs: torch.Tensor  # the stacked partial sums, or x itself
    xs, dtype = (x.parts, x.dtype) if parts else (x, x.dtype)
    m, hdim = xs.shape[-2:]
    h = torch.empty(m, hdim, dtype=dtype, device=xs.device) if residual is not None or parts \
        else x
    if quant:
        y, sc, m_pad = act_buffers(m, hdim, xs.device, 4)
    else:
        y, sc, m_pad = torch.empty_like(h), xs, m
    _rmsnorm_kernel[(m_pad,)](xs, residual if residual is not None else xs, w, y, h, sc, m, hdim,
                              m_pad, eps, xs.shape[0] if parts else 1,
                              HAS_RES=residual is not None, QUANT=quant, PARTS=parts,
                              BLOCK_S=_next_pow2(xs.shape[0]) if parts else 1,
                              BLOCK_H=max(DEFAULT_BLOCK, _next_pow2(hdim)), EXACT=_INTERPRETED,
                              num_warps=8 if parts else 4)
    return (QuantAct(y.view(torch.float8_e4m3fn), sc.t(), m) if quant else y), h


_CACHE_WRITE_HEADS = 8   # heads per program of the decode q/k/v kernel (at most; H200: 8 > 4 > 1)


def qk_norm_rope_cache(qkv: torch.Tensor, qn_w: torch.Tensor, kn_w: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, start: torch.Tensor,
                       pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       nh: int, nkv: int, eps: float, impl: str = "torch",
                       k_exp: torch.Tensor | None = None, v_exp: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """q (B, NH, D); writes k, v of every row into slot `pos` of k_cache / v_cache (B', NKV, L, D).
    FP8 caches (e4m3) come with their scale exponents k_exp / v_exp (B', NKV, L) uint8, and
    v_cache transposed: (B', NKV, D, L)."""
    if impl == "torch":
        return _qk_torch(qkv, qn_w, kn_w, cos, sin, start, pos, k_cache, v_cache, nh, nkv, eps,
                         k_exp, v_exp)
    b = qkv.shape[0]
    d = qn_w.shape[0]
    q = torch.empty(b, nh, d, dtype=qkv.dtype, device=qkv.device)
    fp8 = k_exp is not None
    kc, vc = (k_cache.view(torch.uint8), v_cache.view(torch.uint8)) if fp8 else (k_cache, v_cache)
    ke, ve = (k_exp, v_exp) if fp8 else (kc, vc)
    hb = math.gcd(nh, nkv, _CACHE_WRITE_HEADS)      # heads per program: a power of two
    _qk_rope_cache_kernel[(b, (nh + 2 * nkv) // hb)](
        qkv, qn_w, kn_w, cos, sin, start, pos, q, kc, vc, ke, ve, eps, qkv.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(2), ke.stride(0), ke.stride(1),  # type: ignore[union-attr]  # lint baseline (issue 39)
        NH=nh, NKV=nkv, D=d, HALF=d // 2, HB=hb, FP8_KV=fp8)
    return q


_PREFILL_TOKENS = 16     # tokens per program of the prefill q/k kernel (one per program: 1M
                         # tiny programs at 256 x 128 tokens took 24 ms of a 73 ms prefill)


def qk_norm_rope_prefill(qkv: torch.Tensor, qn_w: torch.Tensor, kn_w: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, start: torch.Tensor, width: int,
                         nh: int, nkv: int, eps: float, impl: str = "torch"
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prefill's q, k, v: qkv (B * P, (NH + 2 NKV) * D) of B left-padded rows of width P ->
    q (B, NH, P, D), k and v (B, NKV, P, D) in qkv's dtype, q and k RMSNormed and rotated at
    slot j - start[b] (clamped at 0: pads), in fp32 inside. One kernel on GPU; the torch path
    is the reference."""
    d = qn_w.shape[0]
    b = qkv.shape[0] // width
    if impl == "torch":
        heads = qkv.view(b, width, nh + 2 * nkv, d).transpose(1, 2).float()  # (B, heads, P, D)
        q, k, v = heads.split([nh, nkv, nkv], dim=1)
        slots = torch.arange(width, device=qkv.device)
        position = (slots[None, :] - start[:, None].long()).clamp(min=0)     # (B, P)
        c, s = cos[position][:, None], sin[position][:, None]                # (B, 1, P, D/2)
        q = _rope_torch(_rmsnorm_torch(q, qn_w, eps)[0], c, s)
        k = _rope_torch(_rmsnorm_torch(k, kn_w, eps)[0], c, s)
        return q.to(qkv.dtype), k.to(qkv.dtype), v.to(qkv.dtype)
    q = torch.empty(b, nh, width, d, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(b, nkv, width, d, dtype=qkv.dtype, device=qkv.device)
    v = torch.empty_like(k)
    tokens = b * width
    _qk_rope_prefill_kernel[(triton.cdiv(tokens, _PREFILL_TOKENS), nh + 2 * nkv)](
        qkv.contiguous(), qn_w, kn_w, cos, sin, start, q, k, v, eps, tokens, width, NH=nh,
        NKV=nkv, D=d, HALF=d // 2, BLOCK_T=_PREFILL_TOKENS)
    return q, k, v


# Split-K decode attention: how many programs make the H200 busy. One wave is every SM running
# _RESIDENT programs of the decode attention kernel at once; 2 is an estimate from its shared
# memory (3 pipeline stages of a 64 x 128 bf16 K and V tile = 96 KB of 228 KB per SM), to be
# checked against ncu's Occupancy section (`bash bench/run_gpu.sh profile`).
H200_SMS = 132
_RESIDENT = 2
_MIN_WAVES, _TARGET_WAVES = 2, 3
_MIN_BLOCKS_PER_SPLIT = 2     # a split's partial (G x D fp32) stays small next to its K/V reads
MAX_SPLITS = 16


def decode_splits(rows: int, kv_heads: int, context: int, block_l: int = 64,
                  sms: int = H200_SMS) -> int:
    """Splits of the context per (row, kv head) for `decode_attention`: 1 (the single-pass
    kernel) when rows x kv_heads programs already fill `_MIN_WAVES` waves; else enough to fill
    ~`_TARGET_WAVES`, at most `MAX_SPLITS` and at most one per `_MIN_BLOCKS_PER_SPLIT` blocks of
    `context`. `context` is the longest context the call can see: under CUDA graphs the grid is
    fixed at capture, so the engine passes the cache length; splits past a row's actual
    context get no blocks and cost one tiny program each."""
    programs = rows * kv_heads
    wave = sms * _RESIDENT
    if programs >= _MIN_WAVES * wave:
        return 1
    by_fill = -(-_TARGET_WAVES * wave // programs)
    by_context = -(-context // block_l) // _MIN_BLOCKS_PER_SPLIT
    return max(1, min(by_fill, by_context, MAX_SPLITS))


# The FP8-cache decode attention reads a row's last tile only up to its context rounded up to
# 16 slots (`_attn_blocks_fp8`'s MASK16), not whole: 3-4 us less per call where that tile is
# partial (256 rows at contexts 897 / 1,025 / 1,153: 126.3 / 141.2 / 156.2 us against 129.9 /
# 145.1 / 160.0; H200, CUDA graphs, 2026-12-03). A module switch so that a bench can time both.
FP8_MASKED_TAIL = True


def fp8_attention_stages(programs: int, splits: int, device: torch.device) -> int:
    """Pipeline stages of the FP8-cache decode attention (`num_stages=None`): 2 for the
    single-pass kernel when its programs fill 2 per SM: one tile loads while one computes, and
    37 KB of shared memory let 4 programs share an SM where 3 stages' 70 KB left room for 3
    (H200, `bench.decode_attention`: 2,048 programs at 256 x 1,024, 136 vs 140 us; 512 at
    64 x 1,024, 37 vs 44). Else Triton's 3: with fewer programs than SMs each one needs the
    deeper pipeline (128 programs at 16 x 4,096: 68 us with 2 stages, 45 with 3); split-K
    keeps 3, as measured before this rule."""
    sms = H200_SMS
    if device.type == "cuda":   # "cuda" without an index: the current device's
        sms = _sm_count(torch.cuda.current_device() if device.index is None else device.index)
    return 2 if splits == 1 and programs >= 2 * sms else 3


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def fp8_mma_supported(device: torch.device) -> bool:
    """e4m3 tensor-core products: NVIDIA compute capability 8.9 and up (Ada, Hopper, Blackwell).
    Elsewhere (older GPUs, ROCm, the interpreter's default) the FP8 decode attention converts to
    fp16 and runs fp16 products."""
    return (device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device) >= (8, 9))


def _launch_fp8_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          k_exp: torch.Tensor, v_exp: torch.Tensor | None, out: torch.Tensor | None,
                          m: torch.Tensor | None, l_sum: torch.Tensor | None,
                          start: torch.Tensor, pos: torch.Tensor, sm_scale: float, splits: int,
                          fp8_mma: tuple[bool, bool] | None, num_stages: int | None,
                          consts: dict) -> None:
    """`decode_attention` over an FP8 cache: checks its layout and launches
    `_decode_attn_fp8_kernel` into `out` (the output, or split-K's partial sums with `m` and
    `l_sum`). `consts`: the launch's constants, completed here (GP, num_stages)."""
    b, _, d = q.shape
    nkv, block_l, g = k_cache.shape[1], consts["BLOCK_L"], consts["G"]
    length = k_cache.shape[2]
    if length % block_l or v_cache.shape[2:] != (d, length):
        raise ValueError(f"decode_attention: an FP8 cache needs V as (rows, kv heads, {d}, "
                         f"L) and L a multiple of block_l {block_l}; got K "
                         f"{tuple(k_cache.shape)}, V {tuple(v_cache.shape)}")
    qk8, pv8 = fp8_mma if fp8_mma is not None else (fp8_mma_supported(q.device),) * 2
    pv8 = pv8 and block_l >= 32             # an e4m3 MMA reduces over 32 at a time
    # The query heads of a KV head are the MMA's N side here, 2 of them for Qwen3: 8 is the
    # narrowest that Hopper's MMA takes (16 before: 143 -> 140 us at 256 x 1,024, 46 -> 44
    # at 64 x 1,024, H200, 3 stages); ROCm's kernels keep 16.
    consts["GP"] = max(16 if torch.version.hip else 8, _next_pow2(g))
    if num_stages is None:
        consts["num_stages"] = fp8_attention_stages(b * nkv, splits, q.device)
    _decode_attn_fp8_kernel[(b, nkv, splits)](
        q, k_cache.view(torch.uint8), v_cache.view(torch.uint8), k_exp, v_exp,
        out, m, l_sum, start, pos, sm_scale, k_cache.stride(0),
        k_cache.stride(1), v_cache.stride(2), k_exp.stride(0), k_exp.stride(1), S=splits,
        QK8=qk8, PV8=pv8, EXACT=_INTERPRETED, MASK16=FP8_MASKED_TAIL, **consts)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     start: torch.Tensor, pos: torch.Tensor, sm_scale: float,
                     impl: str = "torch", block_l: int = 64, k_exp: torch.Tensor | None = None,
                     v_exp: torch.Tensor | None = None, splits: int | None = 1,
                     fp8_mma: tuple[bool, bool] | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, quant_out: bool = False
                     ) -> torch.Tensor | QuantAct:
    """(B, NH, D) attention output of one query per row over slots [start[b], pos]; FP8 caches
    with their scale exponents and V transposed (see `qk_norm_rope_cache`).

    `splits` (triton): 1 = one program per (row, kv head) walks the whole context; S > 1 =
    split-K ("flash-decoding"): S programs per (row, kv head) each over a contiguous share of
    the context's blocks, then a combine kernel; None = `decode_splits` for this batch and the
    cache length. The torch reference ignores it.
    FP8 caches (triton): `fp8_mma` = (QK, PV) products in e4m3 (`_attn_blocks_fp8`; PV only
    with block_l >= 32), None = both where `fp8_mma_supported`; the cache length must be a
    multiple of `block_l` (KVCache pads it). `num_warps` / `num_stages`: Triton's launch
    options (None: its defaults; the FP8 kernel's stages: `fp8_attention_stages`);
    `bench.decode_attention` sweeps them.
    `quant_out`: the output as the o projection's W8A8 input, (B, NH * D) in 1x128 blocks
    (`QuantAct`), quantised in the BF16-cache single-pass kernel's epilogue when D is 128, else
    by the one-pass quantiser after."""
    if impl == "torch":
        out = _attention_torch(q, k_cache, v_cache, start, pos, sm_scale, k_exp, v_exp)
        return quantize_act_fast(out.reshape(out.shape[0], -1), 4, "torch") if quant_out else out
    b, nh, d = q.shape
    nkv = k_cache.shape[1]
    g = nh // nkv
    if splits is None:
        splits = decode_splits(b, nkv, k_cache.shape[2], block_l)
    # Fused into the BF16-cache kernel only: in the FP8-cache kernel the output is transposed
    # (D on the MMA's M side, across warps), and its quantising epilogue cost ~3.7 us per call
    # at 256 x ~1,000 against ~2.1 us for the one-pass quantiser after (decode_profile, H200).
    fused = quant_out and splits == 1 and d == DEFAULT_BLOCK and k_exp is None
    if fused:   # padding rows (a bucket of 1 or 2) must quantise to zeros: no kernel writes them
        qbuf, sc, m_pad = act_buffers(b, nh * d, q.device, 4)
        if m_pad != b:
            qbuf.zero_(), sc.fill_(1.0)
        out = qbuf
    else:
        out, sc, m_pad = torch.empty_like(q), q, b
    consts = dict(G=g, GP=max(16, _next_pow2(g)), NH=nh, D=d, BLOCK_L=block_l)
    consts.update({k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages))
                   if v is not None})
    m = l_sum = acc = None
    if splits > 1:
        m = torch.empty(b, nh, splits, dtype=torch.float32, device=q.device)
        l_sum = torch.empty_like(m)
        acc = torch.empty(b, nh, splits, d, dtype=torch.float32, device=q.device)
    if k_exp is not None:
        _launch_fp8_attention(q, k_cache, v_cache, k_exp, v_exp, out if splits == 1 else acc,
                              m, l_sum, start, pos, sm_scale, splits, fp8_mma, num_stages,
                              consts)
    elif splits == 1:
        _decode_attn_kernel[(b, nkv)](q, k_cache, v_cache, out, sc, start, pos, sm_scale,
                                      k_cache.stride(0), k_cache.stride(1), m_pad, QUANT=fused,
                                      EXACT=_INTERPRETED, **consts)
    else:
        _decode_attn_split_kernel[(b, nkv, splits)](q, k_cache, v_cache, m, l_sum, acc, start,
                                                    pos, sm_scale, k_cache.stride(0),
                                                    k_cache.stride(1), S=splits, **consts)
    if splits > 1:
        _decode_attn_combine_kernel[(b * nh,)](m, l_sum, acc, out, S=splits,
                                               SP=_next_pow2(splits), D=d)
    if fused:
        return QuantAct(qbuf.view(torch.float8_e4m3fn), sc.t(), b)
    return quantize_act_fast(out.view(b, nh * d), 4, impl) if quant_out else out


def silu_mul(x: torch.Tensor, impl: str = "torch", quant: bool = False
             ) -> torch.Tensor | QuantAct:
    """(M, 2I) -> (M, I): silu(gate) * up, gate and up fused as HF's gate_up layout. `quant`:
    as `rmsnorm`'s, the output quantised for the block-scaled GEMM in the same kernel."""
    half = x.shape[-1] // 2
    if impl == "torch":
        x32 = x.float()
        y = (torch.nn.functional.silu(x32[:, :half]) * x32[:, half:]).to(x.dtype)
        return quantize_act_fast(y, 4, "torch") if quant else y
    m = x.shape[0]
    block = min(1024, max(DEFAULT_BLOCK, _next_pow2(half)))
    if quant:
        y, sc, m_pad = act_buffers(m, half, x.device, 4)
    else:
        y, sc, m_pad = torch.empty(m, half, dtype=x.dtype, device=x.device), x, m
    _silu_mul_kernel[(m_pad, triton.cdiv(half, block))](x, y, sc, m, half, m_pad, BLOCK=block,
                                                         QUANT=quant, EXACT=_INTERPRETED)
    return QuantAct(y.view(torch.float8_e4m3fn), sc.t(), m) if quant else y


def _tiles(m: int, n: int) -> tuple[int, int]:
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    # Small GEMMs at decode: narrower N tiles so the grid fills the GPU.
    bn = 32 if triton.cdiv(m, bm) * triton.cdiv(n, 64) < 256 else 64
    return bm, bn


def _split_k(m: int, n: int, kblocks: int, bm: int, bn: int, tiles: dict) -> tuple[int, int]:
    """(K splits, K blocks per split) of a GEMM whose (M, N) output runs in BM x BN tiles:
    skinny GEMMs with few output tiles (o_proj, down_proj at decode) leave most SMs idle, so
    split K until ~2 waves of programs run, each over >= 2 K blocks; `tiles["split"]`
    overrides. Partials go to `_partials` and are summed after the launch."""
    tiles_mn = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = max(1, min(kblocks // 2, 264 // tiles_mn)) if tiles_mn < 132 else 1
    per = triton.cdiv(kblocks, tiles.get("split", split))
    return triton.cdiv(kblocks, per), per


def _partials(split: int, m: int, n: int, dtype: torch.dtype, device: torch.device
              ) -> torch.Tensor:
    """A split-K launch's output: (split, M, N) fp32 partials, or (M, N) in `dtype` unsplit."""
    return torch.empty((split, m, n) if split > 1 else (m, n),
                       dtype=torch.float32 if split > 1 else dtype, device=device)


def w8a16_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None,
                 impl: str = "torch", tiles: dict | None = None) -> torch.Tensor:
    """x (M, K) @ deq(w (N, K)).T -> (M, N) in x's dtype. `w` uint8 (e4m3 bytes) with fp32
    `scale` (ceil(N/128), ceil(K/128)), or a float weight with `scale=None`.

    `tiles` (triton only) overrides the launch: BM, BN, BK (64 or 128), split (K splits),
    num_warps, num_stages; absent keys keep the defaults (`bench.fp8_gemm --sweep` measures
    them)."""
    if impl == "torch":
        wf = w.float() if scale is None else dequantize_weight_block(
            w.view(torch.float8_e4m3fn), scale, DEFAULT_BLOCK, torch.float32)
        return (x.float() @ wf.t()).to(x.dtype)
    m, k = x.shape
    n = w.shape[0]
    t = tiles or {}
    bm, bn = _tiles(m, n)
    bm, bn, bk = t.get("BM", bm), t.get("BN", bn), t.get("BK", 128)
    if bk not in (64, 128):
        raise ValueError(f"w8a16_linear: BK must be 64 or 128 (one scale per K block), got {bk}")
    fp8 = scale is not None
    split, per = _split_k(m, n, triton.cdiv(k, bk), bm, bn, t)
    y = _partials(split, m, n, x.dtype, x.device)
    launch = {key: t[key] for key in ("num_warps", "num_stages") if key in t}
    _linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), split)](
        x, w, scale if fp8 else w, y, m, n, k, scale.stride(0) if fp8 else 0, per * bk,  # type: ignore[union-attr]  # lint baseline (issue 39)
        FP8=fp8, BM=bm, BN=bn, BK=bk, **launch)
    return Partials(y, x.dtype).sum() if split > 1 else y


def w8a8_supported(n: int, k: int, device: torch.device) -> bool:
    """Whether `w8a8_linear` runs an (N, K) weight here: cuBLAS's block-scaled FP8 GEMM
    (`rl.quant.backends.cuda_unavailable_reason`: Hopper, CUDA >= 12.9) with K and N multiples
    of 128 (whole blocks: the producer kernels quantise 1x128 blocks in place)."""
    return k % DEFAULT_BLOCK == 0 and n % DEFAULT_BLOCK == 0 and _block_scaled_ok(device)


@functools.cache
def _block_scaled_ok(device: torch.device) -> bool:
    return cuda_unavailable_reason(device) is None


# `w8a8_triton`'s launch, from a sweep of BN x stages x splits over Qwen3-0.6B / 4B and
# Qwen3-MoE-small decode GEMMs at 16-256 rows (1 x H200, CUDA graphs, weights past L2;
# bench/results/fp8_gemm.md has the engine's choices against cuBLAS): 64-row tiles (wgmma's side;
# TMA zero-fills rows past M); 128-wide for narrow outputs (N <= K: o, down), 64 for wide ones
# (qkv, gate_up); a 4-deep pipeline.
W8A8_STAGES = 4


def _w8a8_tiles(n: int, k: int, tiles: dict) -> tuple[int, int]:
    return tiles.get("BM", 64), tiles.get("BN", 128 if n <= k else 64)


def _w8a8_split(m: int, n: int, k: int, bm: int, bn: int, tiles: dict) -> tuple[int, int]:
    """(K splits, K blocks per split). Narrow outputs (N <= K) have few output tiles: split K
    until about 2 programs per SM of an H200 run (264), each over >= 2 K blocks, while the fp32
    partials (splits x M x N x 4 bytes, written here and read by the RMSNorm) stay within twice
    the weight's bytes. Wide outputs fill the GPU unsplit (their consumers take no partials)."""
    kblocks = triton.cdiv(k, DEFAULT_BLOCK)
    split = 1
    if n <= k:
        tiles_mn = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        split = max(1, min(kblocks // 2, 264 // tiles_mn, k // (2 * m)))
    per = triton.cdiv(kblocks, tiles.get("split", split))
    return triton.cdiv(kblocks, per), per


def w8a8_triton_splits(m: int, n: int, k: int) -> int:
    """K splits `w8a8_triton` launches for an (m, k) x (n, k)^T product at default tiles."""
    bm, bn = _w8a8_tiles(n, k, {})
    return _w8a8_split(m, n, k, bm, bn, {})[0]


def w8a8_triton(act: QuantAct, w: torch.Tensor, scale: torch.Tensor,
                out_dtype: torch.dtype = torch.bfloat16, tiles: dict | None = None,
                partial: bool = False) -> torch.Tensor | Partials:
    """`act` @ deq(w (N, K)).T -> (act.rows, N): the W8A8 product of `w8a8_linear` in our own
    Triton kernel instead of cuBLAS's: TMA-fed and pipelined, with split-K so that decode's few
    output tiles fill the GPU. `tiles` overrides BM, BN, split, num_warps, num_stages
    (`bench.fp8_gemm` measures them). `partial`: a split-K launch returns its `Partials` for the
    consuming `rmsnorm` to sum (no reduction launches here). TMA wants 16-byte aligned rows and
    bases: K a multiple of 16 and the tensors' own storage (the engine's weights and activation
    buffers are)."""
    m, k = act.rows, act.q.shape[1]
    n = w.shape[0]
    for name, x in (("activations", act.q), ("weight", w)):
        if k % 16 or x.data_ptr() % 16 or x.stride(0) != k:
            raise ValueError(f"w8a8_triton: {name} {tuple(x.shape)} are not 16-byte aligned "
                             f"rows of K={k} (TMA needs K % 16 == 0 and an aligned base)")
    t = tiles or {}
    bm, bn = _w8a8_tiles(n, k, t)
    split, per = _w8a8_split(m, n, k, bm, bn, t)
    y = _partials(split, m, n, out_dtype, act.q.device)
    a_desc = TensorDescriptor.from_tensor(act.q.view(torch.float8_e4m3fn), [bm, DEFAULT_BLOCK])
    w_desc = TensorDescriptor.from_tensor(w.view(torch.float8_e4m3fn), [bn, DEFAULT_BLOCK])
    launch = {"num_warps": t["num_warps"]} if "num_warps" in t else {}
    _w8a8_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), split)](
        a_desc, w_desc, act.scale, scale, y, m, n, k, act.q.shape[0], scale.stride(0),
        per * DEFAULT_BLOCK, BM=bm, BN=bn, STAGES=t.get("num_stages", W8A8_STAGES), **launch)
    if split == 1:
        return y
    parts = Partials(y, out_dtype)
    return parts if partial else parts.sum()


def w8a8_linear(x: torch.Tensor | QuantAct, w: torch.Tensor, scale: torch.Tensor,
                impl: str = "torch", out_dtype: torch.dtype | None = None,
                gemm: str = "cublas", partial: bool = False) -> torch.Tensor | Partials:
    """x (M, K) @ deq(w (N, K)).T -> (M, N), both operands e4m3 on the tensor cores: x
    quantised in 1x128 blocks (or already, a `QuantAct` from `rmsnorm` / `silu_mul` with
    quant=True), times the block-FP8 weight (`w` uint8 e4m3 bytes, `scale` fp32 (N / 128,
    K / 128)) on `rl.quant.backends`' block-scaled GEMM (see `w8a8_supported`), or with
    gemm="triton" on `w8a8_triton`. The torch path emulates it (dequantised operands, fp32
    product). Out: x's dtype (a `QuantAct`: out_dtype, default bf16). `partial`: see
    `w8a8_triton` (the other paths return the product)."""
    w8 = w.view(torch.float8_e4m3fn)
    if isinstance(x, QuantAct):
        out_dtype = out_dtype or torch.bfloat16
        if impl == "torch":
            xf = dequantize_act_group(x.q[:x.rows], x.scale[:x.rows])
            return (xf @ dequantize_weight_block(w8, scale, DEFAULT_BLOCK,
                                                 torch.float32).t()).to(out_dtype)
        if gemm == "triton":
            return w8a8_triton(x, w, scale, out_dtype, partial=partial)
        return block_scaled_mm(x, w8, scale, out_dtype)
    if impl != "torch" and gemm == "triton":
        return w8a8_triton(quantize_act_fast(x, 4, impl), w, scale, out_dtype or x.dtype)
    return fp8_linear(x, w8, scale, backend="cuda" if impl != "torch" else "torch",
                      act_quant=True, out_dtype=out_dtype)


_SAMPLE_BLOCK = 1024
_SAMPLE_PROGRAMS = 1056          # ~8 per SM of an H200: the programs per row aim at this


def sample_temperature(logits: torch.Tensor, temperature: float, seed: torch.Tensor,
                       chunks: int | None = None, block: int = _SAMPLE_BLOCK
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V) on the GPU, fp32 or bf16 (read as fp32) -> (tokens (B,) int64,
    temperature-1 log-probs (B,) fp32): a draw from softmax(logits / temperature) per row by
    inverse CDF over `block`-wide tiles (`_sample_pick_kernel`), reading the logits once plus
    one tile. `seed`: int32 (1,) device tensor, drawn per step from the engine's seeded
    generator, so a seeded run repeats. `chunks`: programs per row of the tile pass (None:
    enough for ~8 programs per SM; tests raise it to reach several on a small vocabulary)."""
    b, v = logits.shape
    nt = triton.cdiv(v, block)
    if chunks is None:
        chunks = max(1, min(64, -(-_SAMPLE_PROGRAMS // b)))
    per = triton.cdiv(nt, min(chunks, nt))
    dev = logits.device
    m = torch.empty(b, nt, dtype=torch.float32, device=dev)
    s1 = torch.empty_like(m)
    temp1 = temperature == 1.0
    st = s1 if temp1 else torch.empty_like(m)
    _sample_tiles_kernel[(b, triton.cdiv(nt, per))](logits, m, s1, st, 1.0 / temperature, v,
                                                    logits.stride(0), nt, per, BLOCK=block,
                                                    TEMP1=temp1)
    tok = torch.empty(b, dtype=torch.int64, device=dev)
    lp = torch.empty(b, dtype=torch.float32, device=dev)
    _sample_pick_kernel[(b,)](logits, seed, m, s1, st, tok, lp, 1.0 / temperature, v,
                              logits.stride(0), nt, NTP=_next_pow2(nt), BLOCK=block, TEMP1=temp1)
    return tok, lp


def grouped_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None,
                   offs: torch.Tensor, impl: str = "torch") -> torch.Tensor:
    """x (R, K) rows sorted by expert, w (E, N, K), offs (E+1,) int32 row bounds -> (R, N)."""
    if impl == "torch":
        return _grouped_torch(x, w, scale, offs)
    r, k = x.shape
    e, n, _ = w.shape
    y = torch.empty(r, n, dtype=x.dtype, device=x.device)
    bm = 16 if r <= 16 * e else 64
    bn = 64
    fp8 = scale is not None
    _grouped_kernel[(e, triton.cdiv(n, bn))](
        x, w, scale if fp8 else w, y, offs, n, k, w.stride(0),
        scale.stride(0) if fp8 else 0, scale.stride(1) if fp8 else 0,  # type: ignore[union-attr]  # lint baseline (issue 39)
        FP8=fp8, BM=bm, BN=bn, BK=128)
    return y

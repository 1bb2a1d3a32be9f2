"""The `native` engine's static KV cache: model-dtype rows, or FP8 (`rollout.kv_cache_dtype: fp8`).

Layout: K and V each (layers, rows, NKV, L, D); row b holds one sequence, slot j one token.
An FP8 cache stores V transposed, (layers, rows, NKV, D, L), and pads L to a multiple of
`rl.plan.kv.KV_FP8_SLOT_ALIGN` (128): its decode attention reads K and V^T tiles of 128 slots
straight into e4m3 tensor-core products (`kernels._attn_blocks_fp8`), masked only in 16-slot
steps past a row's context, so every tile lies inside the cache and every byte must be a finite
e4m3 (the cache starts zeroed; both writers store NaN as 0).

FP8: e4m3 values plus one scale per (layer, row, kv head, slot), i.e. per token and kv head,
stored as one byte: the biased exponent of a power-of-two scale (e8m0, scale = 2**(e - 127)).
Per token, because tokens arrive one at a time and a scale must be fixed when its token is
written; a power of two, because one byte is what keeps the cache at D + 1 bytes per head and
token (1.98x the sequences of a bf16 cache at head_dim 128) and dividing by it is exact. The
scale is 2**ceil(log2(amax / 448)), so the largest element lands in (224, 448] and nothing
saturates. The decode attention kernel reads the bytes and folds the scales into the scores
(K) and the softmax weights (V); prefill attends over its own full-precision K and V.

Error of one element (round to nearest e4m3): at most 2**-4 of its magnitude in e4m3's normal
range, at most 2**-10 x scale below it (`quantize_kv`'s test checks both). `store_kv` is the
same quantiser inside the Triton cache-write kernel (tests/rl/rollout/kernel_cases.py compares).
"""
from __future__ import annotations

import torch

from rl.plan.kv import KV_FP8_SCALE_BYTES, gqa_bytes_per_token, native_fp8_slots

try:  # Triton is optional: the CPU engine never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

FP8_MAX = 448.0
_BIAS = 127


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) float -> (e4m3 (..., D), biased scale exponents uint8 (...)). NaN is stored
    as 0 (an FP8 cache holds finite bytes only, see the module docstring)."""
    x = torch.nan_to_num(x.float(), nan=0.0, posinf=float("inf"), neginf=float("-inf"))
    amax = x.detach().abs().amax(-1).float().clamp(min=1e-30)
    mant, exp = torch.frexp(amax / FP8_MAX)                  # r = mant * 2**exp, mant in [.5, 1)
    exp = torch.where(mant == 0.5, exp - 1, exp)             # ceil(log2(r)): 2**exp >= r
    y = (x.float() * kv_scales(_BIAS - exp)[..., None]).clamp(-FP8_MAX, FP8_MAX)  # / 2**exp
    return y.to(torch.float8_e4m3fn), (exp + _BIAS).to(torch.uint8)


def kv_scales(exp: torch.Tensor) -> torch.Tensor:
    """Biased exponents uint8 (...) -> fp32 scales 2**(e - 127) (built from the bits: exact)."""
    return (exp.to(torch.int32) << 23).view(torch.float32)


def dequantize_kv(x8: torch.Tensor, exp: torch.Tensor) -> torch.Tensor:
    """e4m3 (or its uint8 bytes) (..., D), exponents (...) -> fp32 (..., D)."""
    return x8.view(torch.float8_e4m3fn).float() * kv_scales(exp)[..., None]


class KVCache:
    """K and V for `rows` sequences of `max_len` slots (FP8: `slots(max_len, True)`), allocated
    once (CUDA graphs keep pointers into it). FP8: V transposed, and `k_exp` / `v_exp`
    (layers, rows, NKV, L) uint8."""

    def __init__(self, layers: int, rows: int, nkv: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, fp8: bool):
        length = self.slots(max_len, fp8)
        dims = (layers, rows, nkv, length, head_dim)
        store = torch.float8_e4m3fn if fp8 else dtype
        self.fp8, self.rows = fp8, rows
        self.k = torch.zeros(dims, dtype=store, device=device)
        self.v = torch.zeros((layers, rows, nkv, head_dim, length) if fp8 else dims,
                             dtype=store, device=device)
        self.k_exp = self.v_exp = None
        if fp8:
            self.k_exp = torch.full(dims[:-1], _BIAS, dtype=torch.uint8, device=device)
            self.v_exp = torch.full(dims[:-1], _BIAS, dtype=torch.uint8, device=device)

    @staticmethod
    def slots(max_len: int, fp8: bool) -> int:
        """Slots per row: max_len, FP8 rounded up to whole attention tiles (`native_fp8_slots`)."""
        return native_fp8_slots(max_len) if fp8 else max_len

    @staticmethod
    def bytes_per_token(layers: int, nkv: int, head_dim: int, dtype_bytes: int,
                        fp8: bool) -> int:
        """Bytes one token of context holds (all layers, K and V): the planner's formula."""
        return gqa_bytes_per_token(layers, nkv, head_dim, 1 if fp8 else dtype_bytes,
                                   KV_FP8_SCALE_BYTES if fp8 else 0)

    def layer(self, i: int) -> tuple[torch.Tensor, ...]:
        """(k, v, k_exp, v_exp) of layer i, each (rows, NKV, L[, D]) (FP8 v: (rows, NKV, D, L));
        exps None without fp8."""
        if not self.fp8:
            return self.k[i], self.v[i], None, None
        return self.k[i], self.v[i], self.k_exp[i], self.v_exp[i]  # type: ignore[index]  # lint baseline (issue 39)

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Prefill: k, v (B, NKV, P, D) into rows [0, B), slots [0, P) of layer i."""
        b, _, width, _ = k.shape
        if not self.fp8:
            self.k[i, :b, :, :width] = k
            self.v[i, :b, :, :width] = v
            return
        (k8, ke), (v8, ve) = quantize_kv(k), quantize_kv(v)
        self.k[i, :b, :, :width], self.k_exp[i, :b, :, :width] = k8, ke  # type: ignore[index]  # lint baseline (issue 39)
        self.v[i, :b, :, :, :width], self.v_exp[i, :b, :, :width] = v8.transpose(-1, -2), ve  # type: ignore[index]  # lint baseline (issue 39)


# The Triton side of `quantize_kv`, called by the cache-writing kernel in `kernels`.
if triton is not None:
    from rl.quant.fast_quant import e4m3_round

    @triton.jit
    def store_kv(dst, exp_dst, y1, y2, HALF: tl.constexpr, FP8_KV: tl.constexpr, step=None):
        """Write R heads' halves y1, y2 (fp32 (R, HALF)): in dst's dtype, or as e4m3 bytes + one
        scale exponent per head. dst (R, 1): each head's element 0; element i at dst + i, or at
        dst + i * step (FP8 V^T: a column of a (D, L) tile); exp_dst (R,): each head's exponent.
        NaN is stored as 0: the decode attention reads the slots it masks out (up to 15 past
        a row's context, and those before its start), so every byte of an FP8 cache must be a
        finite e4m3 (inf saturates to +-448)."""
        d = tl.arange(0, HALF)[None, :]
        if FP8_KV:
            y1 = tl.where(y1 == y1, y1, 0.0)
            y2 = tl.where(y2 == y2, y2, 0.0)
            amax = tl.maximum(tl.maximum(tl.max(tl.abs(y1), axis=1), tl.max(tl.abs(y2), axis=1)),
                              1e-30)
            # scale = 2**ceil(log2(amax / 448)) from amax's bits, no division: amax = m * 2**E,
            # m in [1, 2), 448 = 1.75 * 2**8, so the exponent is E - 8, + 1 when m > 1.75
            # (mantissa field > 0x600000). Equal to quantize_kv's frexp of the rounded quotient
            # (a quotient within half an ulp of a power of two cannot come from a 24-bit amax).
            abits = amax.to(tl.int32, bitcast=True)
            exp = ((abits >> 23) & 0xFF) - 8 + ((abits & 0x7FFFFF) > 0x600000).to(tl.int32)
            inv = ((254 - exp) << 23).to(tl.float32, bitcast=True)[:, None]
            q1 = e4m3_round(tl.minimum(tl.maximum(y1 * inv, -448.0), 448.0))
            q2 = e4m3_round(tl.minimum(tl.maximum(y2 * inv, -448.0), 448.0))
            q1 = q1.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            q2 = q2.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            if step is None:
                tl.store(dst + d, q1)
                tl.store(dst + HALF + d, q2)
            else:
                tl.store(dst + d * step, q1)
                tl.store(dst + (HALF + d) * step, q2)
            tl.store(exp_dst, exp.to(tl.uint8))
        else:
            ty = dst.dtype.element_ty
            tl.store(dst + d, y1.to(ty))
            tl.store(dst + HALF + d, y2.to(ty))

"""The `native` engine's static KV cache: model-dtype rows, or FP8 (`rollout.kv_cache_dtype: fp8`).

Layout: K and V each (layers, rows, NKV, L, D); row b holds one sequence, slot j one token.

FP8: e4m3 values plus one scale per (layer, row, kv head, slot), i.e. per token and kv head,
stored as one byte: the biased exponent of a power-of-two scale (e8m0, scale = 2**(e - 127)).
Per token, because tokens arrive one at a time and a scale must be fixed when its token is
written; a power of two, because one byte is what keeps the cache at D + 1 bytes per head and
token (1.98x the sequences of a bf16 cache at head_dim 128) and dividing by it is exact. The
scale is 2**ceil(log2(amax / 448)), so the largest element lands in (224, 448] and nothing
saturates. The decode attention kernel reads the bytes and folds the scales into the scores
(K) and the softmax weights (V); prefill attends over its own full-precision K and V.

Error of one element (round to nearest e4m3): at most 2**-4 of its magnitude in e4m3's normal
range, at most 2**-10 x scale below it (`quantize_kv`'s test checks both).
"""
from __future__ import annotations

import torch

from rl.plan.kv import KV_FP8_SCALE_BYTES, gqa_bytes_per_token

FP8_MAX = 448.0
_BIAS = 127


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) float -> (e4m3 (..., D), biased scale exponents uint8 (...))."""
    amax = x.detach().abs().amax(-1).float().clamp(min=1e-30)
    mant, exp = torch.frexp(amax / FP8_MAX)                  # r = mant * 2**exp, mant in [.5, 1)
    exp = torch.where(mant == 0.5, exp - 1, exp)             # ceil(log2(r)): 2**exp >= r
    y = torch.ldexp(x.float(), -exp[..., None]).clamp(-FP8_MAX, FP8_MAX)
    return y.to(torch.float8_e4m3fn), (exp + _BIAS).to(torch.uint8)


def kv_scales(exp: torch.Tensor) -> torch.Tensor:
    """Biased exponents uint8 (...) -> fp32 scales 2**(e - 127) (built from the bits: exact)."""
    return (exp.to(torch.int32) << 23).view(torch.float32)


def dequantize_kv(x8: torch.Tensor, exp: torch.Tensor) -> torch.Tensor:
    """e4m3 (or its uint8 bytes) (..., D), exponents (...) -> fp32 (..., D)."""
    return x8.view(torch.float8_e4m3fn).float() * kv_scales(exp)[..., None]


class KVCache:
    """K and V for `rows` sequences of `max_len` slots, allocated once (CUDA graphs keep
    pointers into it). `k_exp` / `v_exp` (layers, rows, NKV, L) uint8 exist with `fp8` only."""

    def __init__(self, layers: int, rows: int, nkv: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, fp8: bool):
        dims = (layers, rows, nkv, max_len, head_dim)
        store = torch.float8_e4m3fn if fp8 else dtype
        self.fp8, self.rows = fp8, rows
        self.k = torch.zeros(dims, dtype=store, device=device)
        self.v = torch.zeros(dims, dtype=store, device=device)
        self.k_exp = self.v_exp = None
        if fp8:
            self.k_exp = torch.full(dims[:-1], _BIAS, dtype=torch.uint8, device=device)
            self.v_exp = torch.full(dims[:-1], _BIAS, dtype=torch.uint8, device=device)

    @staticmethod
    def bytes_per_token(layers: int, nkv: int, head_dim: int, dtype_bytes: int,
                        fp8: bool) -> int:
        """Bytes one token of context holds (all layers, K and V): the planner's formula."""
        return gqa_bytes_per_token(layers, nkv, head_dim, 1 if fp8 else dtype_bytes,
                                   KV_FP8_SCALE_BYTES if fp8 else 0)

    def layer(self, i: int) -> tuple[torch.Tensor, ...]:
        """(k, v, k_exp, v_exp) of layer i, each (rows, NKV, L[, D]); exps None without fp8."""
        if not self.fp8:
            return self.k[i], self.v[i], None, None
        return self.k[i], self.v[i], self.k_exp[i], self.v_exp[i]

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Prefill: k, v (B, NKV, P, D) into rows [0, B), slots [0, P) of layer i."""
        b, _, width, _ = k.shape
        if not self.fp8:
            self.k[i, :b, :, :width] = k
            self.v[i, :b, :, :width] = v
            return
        for x, data, exp in ((k, self.k, self.k_exp), (v, self.v, self.v_exp)):
            x8, e = quantize_kv(x)
            data[i, :b, :, :width] = x8
            exp[i, :b, :, :width] = e

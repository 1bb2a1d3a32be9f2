"""Attention over packed rows (`trainer.pack_sequences`): one sequence, per-row causal attention.

A packed micro-batch is one sequence of every row's tokens end to end (`rl.trainer.packing`),
with per-row position ids and `cu_seq_lens_q` / `max_length_q` (FlashAttention's names, which
transformers passes from the model's keyword arguments down to each attention call). Each row
attends causally to its own tokens only, at the cost of sum(n_i^2) per layer, not (sum n_i)^2,
and without a (T x T) mask:

- CUDA, bf16 / fp16: `torch.nn.attention.varlen.varlen_attn` (FlashAttention varlen), one call
  for all rows;
- otherwise (CPU, fp32): `scaled_dot_product_attention` with `is_causal` row by row.

`install(model)` selects the `rl_varlen` implementation; without `cu_seq_lens_q` (the padded
path, scoring, generation) it is transformers' SDPA with SDPA's mask, unchanged. DeepSeek-V4's
own attention (`rl.models.v4_attention`) reads the same keyword arguments.
"""
from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

IMPLEMENTATION = "rl_varlen"
"""The `attn_implementation` name registered with transformers."""


_BOUNDS = "_rl_row_bounds"


def row_bounds(cu_seq_lens: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, end)] of each row from cumulative lengths (0, n_0, n_0 + n_1, ...). Read from
    the device once per tensor: the host copy is kept on it (`with_bounds` sets it at packing
    time), so the layers of one forward do not each wait on the GPU."""
    bounds = getattr(cu_seq_lens, _BOUNDS, None)
    if bounds is None:
        cu = cu_seq_lens.tolist()
        bounds = list(zip(cu[:-1], cu[1:]))
        setattr(cu_seq_lens, _BOUNDS, bounds)
    return bounds


def with_bounds(cu_seq_lens: torch.Tensor, host_cu_seq_lens: torch.Tensor) -> torch.Tensor:
    """`cu_seq_lens` (on any device) carrying its rows' bounds, read from its host copy."""
    setattr(cu_seq_lens, _BOUNDS, row_bounds(host_cu_seq_lens))
    return cu_seq_lens


@functools.cache
def _varlen_kernel():
    """torch's varlen attention and the names of its keyword arguments, or None (looked up
    once, not at every layer's call)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     cu_seq_lens: torch.Tensor, max_length: int, scaling: float | None
                     ) -> torch.Tensor:
    """Per-row causal attention of packed (1, H, T, D) query and (1, Hkv, T, D) key / value;
    returns (1, T, H, D)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    fast = (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)
            and query.shape[-1] == value.shape[-1])  # FlashAttention: one head size
    kernel = _varlen_kernel() if fast else None
    if kernel is not None:
        fn, names = kernel
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
        kw: dict = {}
        if "enable_gqa" in names:
            kw["enable_gqa"] = heads != kv_heads
        elif heads != kv_heads:
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
        if "window_size" in names:
            kw["window_size"] = (-1, 0)
        else:
            kw["is_causal"] = True
        if scaling is not None:
            if "scale" in names:
                kw["scale"] = scaling
            else:
                q = q * (scaling * q.shape[-1] ** 0.5)
        cu = cu_seq_lens.to(device=q.device, dtype=torch.int32)
        out = fn(q, k, v, cu, cu, max_length, max_length, **kw)
        return out.unsqueeze(0)  # (1, T, H, D)
    outs = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                           is_causal=True, scale=scaling,
                                           enable_gqa=heads != kv_heads)
            for a, b in row_bounds(cu_seq_lens)]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, sliding_window: int | None = None,
                      cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
                      **kwargs):
    """transformers' attention-function signature: packed rows when `cu_seq_lens_q` is given,
    else `sdpa_attention_forward`."""
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, sliding_window=sliding_window, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention: batch {query.shape[0]}, expected one sequence")
    if sliding_window is not None:
        raise ValueError(f"trainer.pack_sequences: sliding_window={sliding_window} attention "
                         "cannot be packed (expected a model without sliding-window layers)")
    if module.training and dropout > 0:
        raise ValueError(f"trainer.pack_sequences: attention dropout {dropout}, expected 0")
    if max_length_q is None:
        max_length_q = int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
    return packed_attention(query, key, value, cu_seq_lens_q, max_length_q, scaling), None


def _mask(*, attention_mask=None, q_length: int, kv_length: int, q_offset: int = 0, **kwargs):
    # A whole sequence without a padding mask (packed rows, or one unpadded batch): no mask,
    # the attention is causal per row. Otherwise SDPA's mask.
    if attention_mask is None and q_offset == 0 and q_length == kv_length:
        return None
    return sdpa_mask(attention_mask=attention_mask, q_length=q_length, kv_length=kv_length,
                     q_offset=q_offset, **kwargs)


def register() -> None:
    """Register `rl_varlen` with transformers (idempotent)."""
    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, _mask)


def install(model) -> None:
    """Select `rl_varlen` for `model` (a transformers model whose attention is SDPA)."""
    register()
    model.set_attn_implementation(IMPLEMENTATION)

"""DeepSeek-V4 attention for training in memory linear in the sequence length.

`install(model)` turns every `DeepseekV4Attention` of a loaded model into `LinearV4Attention`
(same parameters, same outputs within bf16 rounding) and selects the `linear_v4` attention
implementation, whose model-level mask is the 2-D padding mask instead of eager's (S x S) one.
"""
from __future__ import annotations

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask, flash_attention_mask
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4Attention, eager_attention_forward)

from rl.models.v4_attention.module import LinearV4Attention

IMPLEMENTATION = "linear_v4"
"""The `attn_implementation` name registered with transformers."""


def _mask(*, q_length: int, kv_length: int, q_offset: int = 0, **kwargs):
    # A whole sequence (q_offset 0, no cached keys): the 2-D padding mask (None if no padding),
    # which LinearV4Attention applies block by block. Cached decoding: eager's 4-D mask.
    if q_offset == 0 and q_length == kv_length:
        return flash_attention_mask(q_length=q_length, kv_length=kv_length, **kwargs)
    return eager_mask(q_length=q_length, kv_length=kv_length, q_offset=q_offset, **kwargs)


def register() -> None:
    """Register `linear_v4` with transformers (idempotent). With a KV cache it is eager."""
    AttentionInterface.register(IMPLEMENTATION, eager_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, _mask)


def install(model) -> int:
    """Switch `model` (a transformers DeepSeek-V4) to `LinearV4Attention`; returns the count."""
    register()
    model.set_attn_implementation(IMPLEMENTATION)
    count = 0
    for module in model.modules():
        if type(module) is DeepseekV4Attention:
            # Same class layout and parameters: only forward differs, so the swap keeps the
            # state dict, hooks and DeepSpeed's parameter bookkeeping intact.
            module.__class__ = LinearV4Attention
            count += 1
    return count

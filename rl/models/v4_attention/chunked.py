"""V4 core attention (sliding window + sink + compressed entries) one query block at a time.

What it computes is `eager_attention_forward` of transformers' DeepSeek-V4 with the mask that
model builds: query i sees kv[j] for i - window < j <= i (and key_valid[j]), plus compressed
entries (HCA: every w < threshold[i]; CSA: the indexer's picks topk[i], -1 = none), plus the
per-head sink logit in the softmax denominator. The (S x (S+T)) score matrix never exists: a
block of queries meets only its window of kv and its compressed entries, and under autograd
each block is checkpointed, so the backward recomputes its scores (memory O(block x keys)).
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

QUERY_BLOCK = 128
"""Queries per block; scores per block are (B, heads, block, block + window + entries) fp32."""


def _block_attention(q_BHQD, kv_BSD, comp_BTD, topk_BQK, thr_BQ, valid_BS, sinks_H,
                     q0: int, scale: float, window: int) -> torch.Tensor:
    # The op sequence mirrors eager (bf16 matmul, * scale, fp32 softmax with the sink, probs
    # cast back to the value dtype) so results agree to rounding.
    B, H, Q, D = q_BHQD.shape
    q1 = q0 + Q
    k0 = max(0, q0 - window + 1)
    keys = kv_BSD[:, k0:q1]
    qi = torch.arange(q0, q1, device=q_BHQD.device).view(-1, 1)
    kj = torch.arange(k0, q1, device=q_BHQD.device).view(1, -1)
    seen = (kj <= qi) & (kj > qi - window)  # (Q, L)
    seen = seen.unsqueeze(0)
    if valid_BS is not None:
        seen = seen & valid_BS[:, k0:q1].unsqueeze(1)
    logits = [torch.matmul(q_BHQD, keys.unsqueeze(1).transpose(-1, -2)) * scale]
    masks = [seen.unsqueeze(1)]
    entries = None
    if topk_BQK is not None:  # CSA: each query its own picks
        # index_select, not advanced indexing: its backward is an atomic index_add, while
        # index_put(accumulate) serialises the ~Q x K / T duplicate picks of each entry
        # (measured: ~0.5 s per layer on an H200, whatever the sequence length).
        rows = torch.arange(B, device=q_BHQD.device).view(B, 1, 1) * comp_BTD.shape[1]
        flat = (rows + topk_BQK.clamp(min=0)).flatten()
        entries = comp_BTD.reshape(-1, D).index_select(0, flat).view(B, Q, -1, D)  # (B, Q, K, D)
        s = torch.matmul(q_BHQD.transpose(1, 2), entries.transpose(-1, -2)) * scale
        logits.append(s.transpose(1, 2))  # (B, H, Q, K)
        masks.append((topk_BQK >= 0).unsqueeze(1))
    elif thr_BQ is not None:  # HCA: the causal prefix of the compressed entries
        num = int(thr_BQ.max().clamp(min=0, max=comp_BTD.shape[1]))
        entries = comp_BTD[:, :num]
        logits.append(torch.matmul(q_BHQD, entries.unsqueeze(1).transpose(-1, -2)) * scale)
        w = torch.arange(num, device=q_BHQD.device).view(1, 1, -1)
        masks.append((w < thr_BQ.unsqueeze(-1)).unsqueeze(1))
    logits = [s.float().masked_fill(~m, float("-inf")) for s, m in zip(logits, masks)]
    sink = sinks_H.float().view(1, H, 1, 1).expand(B, H, Q, 1)
    probs = torch.softmax(torch.cat(logits + [sink], dim=-1), dim=-1).to(q_BHQD.dtype)
    n_win = keys.shape[1]
    out = torch.matmul(probs[..., :n_win], keys.unsqueeze(1)).float()
    if topk_BQK is not None:
        p = probs[..., n_win:-1].transpose(1, 2)  # (B, Q, H, K)
        out = out + torch.matmul(p, entries).transpose(1, 2).float()
    elif entries is not None:
        out = out + torch.matmul(probs[..., n_win:-1], entries.unsqueeze(1)).float()
    return out.to(q_BHQD.dtype)


def v4_attention(q_BHSD: torch.Tensor, kv_BSD: torch.Tensor, comp_BTD: torch.Tensor | None,
                 topk_BSK: torch.Tensor | None, thr_BS: torch.Tensor | None,
                 valid_BS: torch.Tensor | None, sinks_H: torch.Tensor, scale: float,
                 window: int, block: int = QUERY_BLOCK) -> torch.Tensor:
    """(B, H, S, D) attention output; see the module docstring for the mask.

    q_BHSD: queries after RoPE. kv_BSD: the single shared K=V head. comp_BTD: compressed entries
    (None on sliding layers). topk_BSK: CSA picks (int64, -1 = none) or None. thr_BS: HCA's
    visible-entry count per query or None. valid_BS: key padding (bool) or None. sinks_H fp32.
    """
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q_BHSD, kv_BSD, comp_BTD, sinks_H))
    outs = []
    for q0 in range(0, q_BHSD.shape[2], block):
        q1 = min(q0 + block, q_BHSD.shape[2])
        args = (q_BHSD[:, :, q0:q1], kv_BSD, comp_BTD,
                None if topk_BSK is None else topk_BSK[:, q0:q1],
                None if thr_BS is None else thr_BS[:, q0:q1], valid_BS, sinks_H, q0, scale, window)
        outs.append(checkpoint(_block_attention, *args, use_reentrant=False) if grad
                    else _block_attention(*args))
    return torch.cat(outs, dim=2)

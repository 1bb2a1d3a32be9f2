"""The compressed KV entries and the indexer's top-k picks of one V4 layer, in O(S) memory.

transformers' `DeepseekV4CSACompressor` / `DeepseekV4HCACompressor` return a (B, 1, S, T)
`block_bias` and the CSA indexer scores all (S, index_heads, T) pairs at once in fp32: at
V4-Flash dims and 18,432 tokens that is ~22 GB per intermediate. Here the compressed entries are
computed the same way (the no-cache, whole-sequence case: training and scoring) and the indexer
scores one query block at a time, keeping only its (B, S, index_topk) picks. The indexer gets
no gradient in eager either (its output is a top-k index), so its scoring runs under no_grad.
On a CUDA device the scores come from one Triton pass (`triton_indexer`) that never holds the
per-head scores.
"""
from __future__ import annotations

import os

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

INDEXER_BLOCK = 512
"""Queries scored per indexer block: (block x index_heads x T) fp32 at a time."""
INDEXER = os.environ.get("RL_V4_INDEXER", "")
""""torch" scores the indexer in torch where the attention runs in Triton (benchmarks compare
them); unset, it follows the attention (`kernel._use_triton`)."""
TRITON_INDEXER_BLOCK = 4096
"""Queries per block on the Triton path, which holds only their (block x T) fp32 scores."""


def _overlap_windows(chunk_kv: torch.Tensor, chunk_gate: torch.Tensor, head_dim: int):
    # The Ca / Cb layout of `DeepseekV4CSACompressor.forward` (no cache): entry w mixes window
    # w-1's first half-channels with window w's second half over 2 * ratio slots.
    batch, n_windows, ratio, _ = chunk_kv.shape
    new_kv = chunk_kv.new_zeros((batch, n_windows, 2 * ratio, head_dim))
    new_gate = chunk_gate.new_full((batch, n_windows, 2 * ratio, head_dim), float("-inf"))
    new_kv[:, :, ratio:] = chunk_kv[..., head_dim:]
    new_gate[:, :, ratio:] = chunk_gate[..., head_dim:]
    if n_windows > 1:
        new_kv[:, 1:, :ratio] = chunk_kv[:, :-1, :, :head_dim]
        new_gate[:, 1:, :ratio] = chunk_gate[:, :-1, :, :head_dim]
    return new_kv, new_gate


def compressed_entries(comp, hidden_states: torch.Tensor, overlap: bool) -> torch.Tensor:
    """(B, T, head_dim) compressed entries of `comp` (a V4 compressor or indexer module).

    `overlap`: the CSA layout (kv/gate project to 2 * head_dim, entries overlap by one window);
    HCA's compressor has none. T = S // compress_rate; an incomplete last window is dropped.
    """
    batch, seq_len, _ = hidden_states.shape
    ratio, head_dim = comp.compress_rate, comp.head_dim
    n_windows = seq_len // ratio
    if n_windows == 0:
        return hidden_states.new_zeros((batch, 0, head_dim))
    usable = n_windows * ratio
    chunk_kv = comp.kv_proj(hidden_states[:, :usable]).view(batch, n_windows, ratio, -1)
    chunk_gate = comp.gate_proj(hidden_states[:, :usable]).view(batch, n_windows, ratio, -1)
    chunk_gate = chunk_gate + comp.position_bias
    if overlap:
        chunk_kv, chunk_gate = _overlap_windows(chunk_kv, chunk_gate, head_dim)
    weights = chunk_gate.softmax(dim=2, dtype=torch.float32).to(chunk_kv.dtype)
    compressed = comp.kv_norm((chunk_kv * weights).sum(dim=2))
    positions = (torch.arange(n_windows, device=compressed.device) * ratio).unsqueeze(0)
    cos, sin = comp.rotary_emb(compressed, position_ids=positions.expand(batch, -1),
                               layer_type=comp.rope_layer_type)
    return apply_rotary_pos_emb(compressed.unsqueeze(1), cos, sin).squeeze(1)


@torch.no_grad()
def indexer_topk(indexer, hidden_states: torch.Tensor, q_residual: torch.Tensor,
                 position_ids: torch.Tensor, block: int = INDEXER_BLOCK) -> torch.Tensor:
    """(B, S, min(index_topk, T)) int64 picks of `DeepseekV4Indexer`, -1 where not causal.

    Same arithmetic as `DeepseekV4Indexer.forward` + `DeepseekV4IndexerScorer.forward` without
    a cache, one block of `block` queries at a time.
    """
    from rl.models.v4_attention.kernel import _use_triton
    batch, seq_len, _ = hidden_states.shape
    keys = compressed_entries(indexer, hidden_states, overlap=True)  # (B, T, d)
    d = indexer.head_dim  # the Triton tiles: a power of two, at least an MMA's 16
    fused = _use_triton(keys) and INDEXER != "torch" and d >= 16 and d & (d - 1) == 0
    if fused:
        from rl.models.v4_attention.triton_indexer import index_scores
        block = max(block, TRITON_INDEXER_BLOCK)
    else:
        keys = keys.float()
    num_entries = keys.shape[1]
    top_k = min(indexer.index_topk, num_entries)
    if num_entries == 0:
        return torch.full((batch, seq_len, 0), -1, dtype=torch.long, device=hidden_states.device)
    cos_q, sin_q = indexer.rotary_emb(hidden_states, position_ids=position_ids,
                                      layer_type=indexer.rope_layer_type)
    scorer = indexer.scorer
    threshold = (position_ids + 1) // indexer.compress_rate  # (B or 1, S)
    threshold = threshold.expand(batch, -1)
    entry = torch.arange(num_entries, device=keys.device)
    out = []
    for s0 in range(0, seq_len, block):
        s1 = min(s0 + block, seq_len)
        q = indexer.q_b_proj(q_residual[:, s0:s1])
        q = q.view(batch, s1 - s0, -1, indexer.head_dim).transpose(1, 2)
        q = apply_rotary_pos_emb(q, cos_q[:, s0:s1], sin_q[:, s0:s1]).transpose(1, 2)
        weights = scorer.weights_proj(hidden_states[:, s0:s1]).float() * scorer.weights_scaling
        thr = threshold[:, s0:s1].unsqueeze(-1)
        if fused:
            scores = index_scores(q, keys, weights * scorer.softmax_scale, thr[..., 0])
        else:
            scores = torch.matmul(q.float(), keys.transpose(-1, -2).unsqueeze(1))  # (B, s, H, T)
            scores = torch.relu(scores) * scorer.softmax_scale
            scores = (scores * weights.unsqueeze(-1)).sum(dim=2)  # (B, s, T)
            scores = scores.masked_fill(entry.view(1, 1, -1) >= thr, float("-inf"))
        picks = scores.topk(top_k, dim=-1).indices
        out.append(torch.where(picks >= thr, torch.full_like(picks, -1), picks))
    return torch.cat(out, dim=1)

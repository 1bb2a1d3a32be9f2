"""Triton forward of `v4_attention` (flash-style online softmax, one token's heads per program).

V4 has one shared K=V head, so all heads of a token see the same keys: a program takes one
token's (padded) heads as the M side of the MMAs and walks its keys in BLOCK_N tiles: the
sliding window (contiguous rows of kv), then the compressed entries (HCA: the causal prefix;
CSA: the indexer's picks, gathered by index). The softmax state starts at the sink logit
(m = sink, l = 1), which puts the sink in the denominator and keeps m finite for queries with
no visible key. The accumulator holds DV of the head's D output channels (head_dim 512 gives an
fp32 accumulator too large for one program's registers), so the D / DV programs of a token each
recompute q.k; the scores are never stored, only each (token, head)'s logsumexp (the sink
included) when the backward asks for it. Backward: `triton_bwd.py` (or `kernel.py`'s recompute).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _window_keys(t, n0, offs_n, window, valid_row, HAS_VALID: tl.constexpr):
    # Token t's sliding-window keys n0 .. n0 + BLOCK_N - 1 of t - window + 1 .. t: their
    # positions j and which count (causal, in the sequence, not padding; valid_row: the
    # sequence's padding flags).
    j = t - window + 1 + n0 + offs_n
    ok = (j >= 0) & (j <= t)
    if HAS_VALID:
        ok = ok & (tl.load(valid_row + j, mask=ok, other=0) != 0)
    return j, ok


@triton.jit
def _tile(q, rows, ok, offs_d, offs_dv, m_i, l_i, acc, scale):
    # rows: (BLOCK_N,) pointers to the first channel of each key row; ok: which rows count.
    k = tl.load(rows[None, :] + offs_d[:, None], mask=ok[None, :], other=0.0)  # (D, N)
    s = tl.dot(q, k) * scale  # (H, N) fp32
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(rows[:, None] + offs_dv[None, :], mask=ok[:, None], other=0.0)  # (N, DV)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _v4_attn_fwd(q_ptr, kv_ptr, comp_ptr, topk_ptr, thr_ptr, valid_ptr, sinks_ptr, out_ptr,
                 lse_ptr, S, T, H, K, window, scale,
                 sq_b, sq_h, sq_s, so_b, so_h, so_s,
                 MODE: tl.constexpr, HAS_VALID: tl.constexpr, STORE_LSE: tl.constexpr,
                 D: tl.constexpr,
                 DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    n_split: tl.constexpr = D // DV
    b = tl.program_id(1) // n_split
    dv0 = (tl.program_id(1) % n_split) * DV
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    offs_dv = dv0 + tl.arange(0, DV)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < H
    q = tl.load(q_ptr + b * sq_b + t * sq_s + offs_h[:, None] * sq_h + offs_d[None, :],
                mask=h_ok[:, None], other=0.0)
    m_i = tl.load(sinks_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    l_i = tl.full((BLOCK_H,), 1.0, tl.float32)
    acc = tl.zeros((BLOCK_H, DV), tl.float32)
    kv_b = kv_ptr + b.to(tl.int64) * S * D
    # sliding window: keys t - window + 1 .. t
    for n0 in range(0, window, BLOCK_N):
        j, ok = _window_keys(t, n0, offs_n, window, valid_ptr + b * S, HAS_VALID)
        m_i, l_i, acc = _tile(q, kv_b + j.to(tl.int64) * D, ok, offs_d, offs_dv, m_i, l_i, acc,
                              scale)
    comp_b = comp_ptr + b.to(tl.int64) * T * D
    if MODE == 1:  # CSA: the indexer's picks (-1 = none)
        for n0 in range(0, K, BLOCK_N):
            idx = tl.load(topk_ptr + (b * S + t).to(tl.int64) * K + n0 + offs_n,
                          mask=n0 + offs_n < K, other=-1)
            ok = idx >= 0
            m_i, l_i, acc = _tile(q, comp_b + idx * D, ok, offs_d, offs_dv, m_i, l_i, acc,
                                  scale)
    if MODE == 2:  # HCA: entries 0 .. thr - 1
        n_vis = tl.minimum(tl.load(thr_ptr + b * S + t), T)
        for n0 in range(0, n_vis, BLOCK_N):
            w = n0 + offs_n
            ok = w < n_vis
            m_i, l_i, acc = _tile(q, comp_b + w.to(tl.int64) * D, ok, offs_d, offs_dv, m_i,
                                  l_i, acc, scale)
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * so_b + t * so_s + offs_h[:, None] * so_h + offs_dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
    if STORE_LSE:  # every D / DV program of the token has the same m, l: the first stores
        if dv0 == 0:
            tl.store(lse_ptr + (b * S + t) * H + offs_h, m_i + tl.log(l_i), mask=h_ok)


def v4_attention_fwd(q_BHSD, kv_BSD, comp_BTD, topk_BSK, thr_BS, valid_BS, sinks_H, scale,
                     window, block_n: int = 64, dv: int | None = None, return_lse: bool = False):
    """Forward of `chunked.v4_attention` (same arguments); returns (B, H, S, D), and with
    `return_lse` also the (B, S, H) fp32 logsumexp of each softmax row (scaled logits and sink)."""
    B, H, S, D = q_BHSD.shape
    if q_BHSD.stride(3) != 1:
        q_BHSD = q_BHSD.contiguous()
    kv = kv_BSD.contiguous()
    mode = 1 if topk_BSK is not None else 2 if thr_BS is not None else 0
    comp = comp_BTD.contiguous() if comp_BTD is not None else kv.new_zeros(B, 1, D)
    T = comp.shape[1]
    topk = topk_BSK.contiguous() if mode == 1 else kv.new_zeros(1, dtype=torch.long)
    thr = thr_BS.to(torch.int32).contiguous() if mode == 2 else kv.new_zeros(1, dtype=torch.int32)
    valid = valid_BS.to(torch.int8).contiguous() if valid_BS is not None else thr
    # (B, S, H, D) storage: what the caller transposes to anyway
    out = torch.empty(B, S, H, D, dtype=q_BHSD.dtype, device=q_BHSD.device).transpose(1, 2)
    lse = torch.empty(B, S, H, dtype=torch.float32, device=q_BHSD.device) if return_lse else thr
    dv = dv or min(D, 256)
    grid = (S, B * (D // dv))
    args = (q_BHSD, kv, comp, topk, thr, valid, sinks_H.float().contiguous(), out, lse,
            S, T, H, topk.shape[-1] if mode == 1 else 0, window, scale,
            q_BHSD.stride(0), q_BHSD.stride(1), q_BHSD.stride(2),
            out.stride(0), out.stride(1), out.stride(2))
    meta = dict(MODE=mode, HAS_VALID=valid_BS is not None, STORE_LSE=return_lse, D=D, DV=dv,
                BLOCK_H=max(16, triton.next_power_of_2(H)), num_warps=8 if dv >= 256 else 4)
    # Tiles of head_dim 512 press on shared memory: fall back to smaller ones if a config
    # does not fit, and remember the first that did.
    key = (D, dv, meta["BLOCK_H"])
    for bn, stages in _TILES.get(key, [(block_n, 2), (32, 2), (32, 1), (16, 1)]):
        try:
            _v4_attn_fwd[grid](*args, BLOCK_N=bn, num_stages=stages, **meta)
        except triton.runtime.errors.OutOfResources:
            continue
        _TILES[key] = [(bn, stages)]
        return (out, lse) if return_lse else out
    raise RuntimeError(f"no Triton tile config fits head_dim {D}")


_TILES: dict[tuple, list[tuple[int, int]]] = {}

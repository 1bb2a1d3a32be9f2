"""Triton scores of V4's CSA indexer: one pass over the compressed entries, no per-head scores.

The indexer's score of query s for compressed entry t is
    sum over its index heads h of  w[s, h] * relu(q[s, h] . k[t])
(`DeepseekV4IndexerScorer`; w folds in the softmax scale and the weights' scaling), visible when
t < thr[s]. Computed in torch (`compress.indexer_topk`'s CPU path) each query block materialises
(block x heads x entries) fp32 scores and reads them three more times; at V4-Flash dims (64
heads of 128, 4,608 entries at 18,432 tokens) that is ~100 ms of a CSA layer's forward. Here a
program takes BLOCK_M queries x BLOCK_N entries, keeps the entries' tile in registers, and
accumulates the heads' ReLU'd dot products (tensor-core MMAs, fp32 accumulation) into one
(BLOCK_M, BLOCK_N) tile: only the (S, T) scores reach memory, and tiles that no query of the
block can see are written as -inf without computing. The q . k products of bf16 operands are
exact in the MMA, as in the fp32 matmul of the torch path; only the order of the sums differs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _index_scores(q_ptr, k_ptr, w_ptr, thr_ptr, out_ptr, S, T, H,
                  sq_b, sq_s, sq_h, sk_b, sk_t, sw_b, sw_s, st_b, so_b, so_s,
                  D: tl.constexpr, IEEE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(2)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    m_ok = offs_m < S
    n_ok = offs_n < T
    thr = tl.load(thr_ptr + b * st_b + offs_m, mask=m_ok, other=0)
    # a tile no query of the block sees: no head is summed, the mask below writes -inf
    n_heads = tl.where(tl.program_id(1) * BLOCK_N < tl.max(thr, 0), H, 0)
    k = tl.load(k_ptr + b.to(tl.int64) * sk_b + offs_n[None, :].to(tl.int64) * sk_t
                + offs_d[:, None], mask=n_ok[None, :], other=0.0)  # (D, N)
    q_rows = q_ptr + b.to(tl.int64) * sq_b + offs_m[:, None].to(tl.int64) * sq_s + offs_d[None, :]
    w_rows = w_ptr + b.to(tl.int64) * sw_b + offs_m.to(tl.int64) * sw_s
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for h in range(0, n_heads):
        q = tl.load(q_rows + h * sq_h, mask=m_ok[:, None], other=0.0)  # (M, D)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        w = tl.load(w_rows + h, mask=m_ok, other=0.0)
        acc += tl.maximum(s, 0.0) * w[:, None]
    acc = tl.where(offs_n[None, :] < thr[:, None], acc, float("-inf"))
    tl.store(out_ptr + b.to(tl.int64) * so_b + offs_m[:, None].to(tl.int64) * so_s
             + offs_n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


def index_scores(q_BSHD: torch.Tensor, k_BTD: torch.Tensor, w_BSH: torch.Tensor,
                 thr_BS: torch.Tensor, block_m: int = 64, block_n: int = 64) -> torch.Tensor:
    """(B, S, T) fp32 scores sum_h w[b,s,h] * relu(q[b,s,h] . k[b,t]), -inf where t >= thr[b,s].

    q: (B, S, H, D) bf16 / fp16 / fp32 (fp32: IEEE products, no TF32), k: (B, T, D) of q's
    dtype, w: (B, S, H) fp32, thr: (B, S) integer.
    """
    B, S, H, D = q_BSHD.shape
    T = k_BTD.shape[1]
    if q_BSHD.stride(3) != 1:
        q_BSHD = q_BSHD.contiguous()
    k = k_BTD.to(q_BSHD.dtype).contiguous()
    w = w_BSH.float().contiguous()
    thr = thr_BS.to(torch.int32).contiguous()
    out = torch.empty(B, S, T, dtype=torch.float32, device=q_BSHD.device)
    if S == 0 or T == 0:
        return out
    grid = (triton.cdiv(S, block_m), triton.cdiv(T, block_n), B)
    _index_scores[grid](q_BSHD, k, w, thr, out, S, T, H,
                        q_BSHD.stride(0), q_BSHD.stride(1), q_BSHD.stride(2),
                        k.stride(0), k.stride(1), w.stride(0), w.stride(1), thr.stride(0),
                        out.stride(0), out.stride(1),
                        D=D, IEEE=q_BSHD.dtype == torch.float32,
                        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, num_stages=2)
    return out

"""Two-pass Triton backward of `v4_attention`: the scores once per token, then the gradients.

`triton_bwd.py` splits head_dim into D / DV programs per token (a (heads x 512) fp32 dq does not
fit one program's registers), and each of them recomputes the full-D s = q.k and dp = dO.k and
keeps the token's q and dO (heads x D, 64 KB each in bf16 at Flash dims) resident: no shared
memory is left for BLOCK_N = 64 or a second pipeline stage. At Flash dims (18,432 tokens, CSA
top-512, window 128, 64 x 512 heads) on an H200 it takes 65 ms against the forward's 16.5 ms;
its key-gradient MMAs alone cost 22 ms of that (the fp32 atomics nothing).

Here, per chunk of tokens (the keys of each token in the order `triton_bwd.py` walks them:
window, then CSA's picks or HCA's prefix):
- pass 1 (`_bwd_scores`, one program per token, full D): s and dp of each key tile, once;
  stores p = exp(s - lse) and ds = p * (dp - delta) * scale in the input dtype (what the MMAs
  of `triton_bwd.py` round them to anyway) into (chunk, padded heads, key columns) buffers,
  0 where a key does not count, and writes d sink as `triton_bwd.py` does;
- pass 2 (`_bwd_grads`, one program per (token, DV channels)): loads those p / ds tiles and
  does the DV-sized MMAs alone: dq += ds @ v, and each key's ds^T @ q + p^T @ dO, added
  atomically into fp32 dkv / dcomp. It holds only (heads x DV) of q and dO, which leaves room
  for BLOCK_N = 64 tiles and two stages.
Per key and head the MMAs shrink from 2 x 2D (s and dp in each of the two DV = 256 programs)
+ 3D to 2D + 3D multiply-adds. The buffers cost 2 x heads x key columns x dtype bytes per token
(160 KB at Flash dims in bf16: window 128 + 512 picks; 3 GB written and read back over 18,432
tokens), which `CHUNK_BYTES` bounds; a key column's place does not depend on the passes'
BLOCK_N (window columns, then picks / prefix columns, each padded to `PAD`). Measured at Flash
dims on an H100 (`bench/results/v4_attention_h100_csa.md`): 20.8 ms against the one-pass 71.8 ms;
the kernel `kernel.attention` takes by default.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl.models.v4_attention.triton_bwd import (Tiles, _coprime_stride, _key_grads, _operands,
                                               _probs)
from rl.models.v4_attention.triton_fwd import _window_keys

PAD = 64
"""Key columns of the window part and of the picks / prefix part are padded to a multiple of this
(the largest BLOCK_N allowed), so both passes' tiles stay inside the buffer unmasked."""
CHUNK_BYTES = 1 << 30
"""At most this many bytes of p and ds buffers: tokens are processed in chunks that fit."""


@triton.jit
def _scores_tile(q, do, rows, ok, offs_d, lse, delta, scale, p_at, ds_at):
    # `triton_bwd._probs` of a key tile, stored at p_at / ds_at: (H, N) pointers to the tile's
    # place in the buffers.
    p, ds = _probs(q, do, rows, ok, offs_d, lse, delta, scale)
    tl.store(p_at, p.to(p_at.dtype.element_ty))
    tl.store(ds_at, ds.to(ds_at.dtype.element_ty))


@triton.jit
def _bwd_scores(q_ptr, o_ptr, do_ptr, kv_ptr, comp_ptr, topk_ptr, thr_ptr, valid_ptr, sinks_ptr,
                lse_ptr, p_ptr, ds_ptr, dsink_ptr, g0, S, T, H, K, window, w_cols, n_cols,
                scale, sq_b, sq_h, sq_s, so_b, so_h, so_s,
                MODE: tl.constexpr, HAS_VALID: tl.constexpr, D: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    # Token g0 + c of the flattened (batch, sequence); c is its row of the chunk's buffers.
    c = tl.program_id(0).to(tl.int64)  # int64: t * sq_s and the buffer offsets pass 2**31
    b = (g0 + c) // S
    t = (g0 + c) % S
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h[:, None] < H
    o_row = b * so_b + t * so_s + offs_h[:, None] * so_h
    q = tl.load(q_ptr + b * sq_b + t * sq_s + offs_h[:, None] * sq_h + offs_d[None, :],
                mask=h_ok, other=0.0)
    do = tl.load(do_ptr + o_row + offs_d[None, :], mask=h_ok, other=0.0)
    o = tl.load(o_ptr + o_row + offs_d[None, :], mask=h_ok, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)  # (H,)
    lse_at = (b * S + t) * H + offs_h
    # padded heads: lse = inf makes their p and ds 0 (their buffer rows hold zeros)
    lse = tl.load(lse_ptr + lse_at, mask=offs_h < H, other=float("inf"))
    sink = tl.load(sinks_ptr + offs_h, mask=offs_h < H, other=0.0)
    tl.store(dsink_ptr + lse_at, -tl.exp(sink - lse) * delta, mask=offs_h < H)
    at = (c * BLOCK_H + offs_h[:, None]) * n_cols + offs_n[None, :]  # (H, N) buffer offsets
    # sliding window: keys t - window + 1 .. t, columns 0 .. window - 1
    for n0 in range(0, window, BLOCK_N):
        j, ok = _window_keys(t, n0, offs_n, window, valid_ptr + b * S, HAS_VALID)
        _scores_tile(q, do, kv_ptr + (b * S + j) * D, ok, offs_d, lse, delta, scale,
                     p_ptr + at + n0, ds_ptr + at + n0)
    if MODE == 1:  # CSA: the indexer's picks (-1 = none), columns w_cols + pick
        for n0 in range(0, K, BLOCK_N):
            idx = tl.load(topk_ptr + (b * S + t) * K + n0 + offs_n, mask=n0 + offs_n < K,
                          other=-1)
            _scores_tile(q, do, comp_ptr + (b * T + idx) * D, idx >= 0, offs_d, lse, delta,
                         scale, p_ptr + at + w_cols + n0, ds_ptr + at + w_cols + n0)
    if MODE == 2:  # HCA: entries 0 .. thr - 1, columns w_cols + entry
        n_vis = tl.minimum(tl.load(thr_ptr + b * S + t), T)
        for n0 in range(0, n_vis, BLOCK_N):
            _scores_tile(q, do, comp_ptr + (b * T + n0 + offs_n) * D, n0 + offs_n < n_vis,
                         offs_d, lse, delta, scale, p_ptr + at + w_cols + n0,
                         ds_ptr + at + w_cols + n0)


@triton.jit
def _grads_tile(p_at, ds_at, qv, dov, rows, drows, ok, offs_dv, dq):
    # `triton_bwd._key_grads` of the tile pass 1 stored at p_at / ds_at ((H, N) pointers into
    # the buffers, 0 where a key does not count).
    return _key_grads(tl.load(p_at), tl.load(ds_at), qv, dov, rows, drows, ok, offs_dv, dq)


@triton.jit
def _bwd_grads(q_ptr, do_ptr, kv_ptr, comp_ptr, topk_ptr, thr_ptr, valid_ptr, p_ptr, ds_ptr,
               dq_ptr, dkv_ptr, dcomp_ptr, g0, n_tok, c_stride, S, T, H, K, window, w_cols,
               n_cols, sq_b, sq_h, sq_s, so_b, so_h, so_s,
               MODE: tl.constexpr, HAS_VALID: tl.constexpr, D: tl.constexpr,
               DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    # do and dq share one layout (so_*). A token's D / DV programs are launched side by side:
    # the second reads its p / ds tiles from L2. Tokens launched together are c_stride (>=
    # window, coprime with the chunk's n_tok) apart, as in `triton_bwd.py`: their windows do not
    # overlap, so their atomic adds into dkv do not queue on the same rows.
    n_split: tl.constexpr = D // DV
    c = (tl.program_id(0).to(tl.int64) // n_split * c_stride) % n_tok
    b = (g0 + c) // S
    t = (g0 + c) % S
    offs_h = tl.arange(0, BLOCK_H)
    offs_dv = (tl.program_id(0) % n_split) * DV + tl.arange(0, DV)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h[:, None] < H
    o_row = b * so_b + t * so_s + offs_h[:, None] * so_h
    qv = tl.load(q_ptr + b * sq_b + t * sq_s + offs_h[:, None] * sq_h + offs_dv[None, :],
                 mask=h_ok, other=0.0)
    dov = tl.load(do_ptr + o_row + offs_dv[None, :], mask=h_ok, other=0.0)
    at = (c * BLOCK_H + offs_h[:, None]) * n_cols + offs_n[None, :]
    dq = tl.zeros((BLOCK_H, DV), tl.float32)
    for n0 in range(0, window, BLOCK_N):
        j, ok = _window_keys(t, n0, offs_n, window, valid_ptr + b * S, HAS_VALID)
        rows = (b * S + j) * D
        dq = _grads_tile(p_ptr + at + n0, ds_ptr + at + n0, qv, dov, kv_ptr + rows,
                         dkv_ptr + rows, ok, offs_dv, dq)
    if MODE == 1:
        for n0 in range(0, K, BLOCK_N):
            idx = tl.load(topk_ptr + (b * S + t) * K + n0 + offs_n, mask=n0 + offs_n < K,
                          other=-1)
            rows = (b * T + idx) * D
            dq = _grads_tile(p_ptr + at + w_cols + n0, ds_ptr + at + w_cols + n0, qv, dov,
                             comp_ptr + rows, dcomp_ptr + rows, idx >= 0, offs_dv, dq)
    if MODE == 2:
        n_vis = tl.minimum(tl.load(thr_ptr + b * S + t), T)
        for n0 in range(0, n_vis, BLOCK_N):
            rows = (b * T + n0 + offs_n) * D
            dq = _grads_tile(p_ptr + at + w_cols + n0, ds_ptr + at + w_cols + n0, qv, dov,
                             comp_ptr + rows, dcomp_ptr + rows, n0 + offs_n < n_vis, offs_dv,
                             dq)
    tl.store(dq_ptr + o_row + offs_dv[None, :], dq.to(dq_ptr.dtype.element_ty), mask=h_ok)


SCORES = Tiles("RL_V4_ATTENTION_BWD2_SCORES_TILES", ("BLOCK_N", "num_warps", "num_stages"),
               [(32, 8, 1), (64, 8, 1), (16, 8, 1)], [(16, 4, 1)], max_block_n=PAD)
"""Pass 1's (BLOCK_N, num_warps, num_stages), timed on the first backward of a (head_dim, heads,
dtype) on a GPU unless the env var pins them. q and dO stay resident at full D (128 KB at Flash
dims in bf16) beside a (D x BLOCK_N) key tile: one stage."""
GRADS = Tiles("RL_V4_ATTENTION_BWD2_GRADS_TILES", ("BLOCK_N", "DV", "num_warps", "num_stages"),
              [(64, 128, 8, 2), (64, 256, 8, 1), (64, 128, 4, 2), (32, 256, 8, 2),
               (32, 128, 4, 2), (64, 64, 4, 2), (64, 32, 4, 2)],
              [(32, 64, 4, 1), (16, 64, 4, 1)],
              max_block_n=PAD)
"""Pass 2's (BLOCK_N, DV, num_warps, num_stages), timed likewise. Smaller DV: more programs
reload the same p / ds and key tiles, but smaller register accumulators (dq, the keys' dkv)."""


def v4_attention_bwd2(grad_BHSD, q_BHSD, kv_BSD, comp_BTD, topk_BSK, thr_BS, valid_BS,
                      sinks_H, out_BHSD, lse_BSH, scale, window):
    """`triton_bwd.v4_attention_bwd` (same arguments and results) in two passes."""
    B, H, S, D = q_BHSD.shape
    grad, q, out, kv, comp, topk, thr, valid, mode = _operands(
        grad_BHSD, q_BHSD, out_BHSD, kv_BSD, comp_BTD, topk_BSK, thr_BS, valid_BS)
    T = comp.shape[1]
    K = topk.shape[-1] if mode == 1 else 0
    block_h = max(16, triton.next_power_of_2(H))
    w_cols = triton.cdiv(window, PAD) * PAD
    n_cols = w_cols + triton.cdiv(K if mode == 1 else T if mode == 2 else 0, PAD) * PAD
    chunk = min(B * S, max(1, CHUNK_BYTES // (2 * block_h * n_cols * q.element_size())))
    # zeros: pass 2's tiles may be wider than pass 1's and read columns pass 1 never writes.
    # Their keys do not count (masked out of v and of the atomics), but ds @ v would still
    # carry a NaN of uninitialised memory into dq.
    p_buf, ds_buf = q.new_zeros(2, chunk, block_h, n_cols)
    dq = torch.empty_like(out, dtype=q.dtype)
    dkv = torch.empty(B, S, D, dtype=torch.float32, device=kv.device)
    dcomp = torch.empty(B, T, D, dtype=torch.float32, device=kv.device)
    dsink = torch.empty(B, S, H, dtype=torch.float32, device=kv.device)
    dims = (S, T, H, K, window, w_cols, n_cols)
    strides = (q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1),
               out.stride(2))
    meta = dict(MODE=mode, HAS_VALID=valid_BS is not None, D=D, BLOCK_H=block_h)
    chunks = [(g0, min(chunk, B * S - g0)) for g0 in range(0, B * S, chunk)]
    sinks, lse = sinks_H.float().contiguous(), lse_BSH.contiguous()

    def scores(config, g0, n):
        block_n, warps, stages = config
        _bwd_scores[(n,)](q, out, grad, kv, comp, topk, thr, valid, sinks, lse, p_buf,
                          ds_buf, dsink, g0, *dims, scale, *strides, BLOCK_N=block_n,
                          num_warps=warps, num_stages=stages, **meta)

    def grads(config, g0, n):
        block_n, dv, warps, stages = config
        _bwd_grads[(n * (D // dv),)](q, grad, kv, comp, topk, thr, valid, p_buf, ds_buf, dq,
                                     dkv, dcomp, g0, n, _coprime_stride(window, n), *dims,
                                     *strides, DV=dv, BLOCK_N=block_n, num_warps=warps,
                                     num_stages=stages, **meta)

    # Each pass is timed over all chunks on a key's first call (pass 2 on whatever pass 1 left
    # in the buffers: the times do not depend on the values); the real run follows.
    key = (D, block_h, q.dtype)
    tiles1 = SCORES(key, lambda c: [scores(c, *ch) for ch in chunks])
    tiles2 = GRADS(key, lambda c: [grads(c, *ch) for ch in chunks])
    dkv.zero_()
    dcomp.zero_()
    for ch in chunks:
        scores(tiles1, *ch)
        grads(tiles2, *ch)
    return (dq, dkv.to(kv_BSD.dtype), None if comp_BTD is None else dcomp.to(comp_BTD.dtype),
            dsink.sum((0, 1)).to(sinks_H.dtype))

"""One-pass Triton backward of `v4_attention` (flash-style: recompute the scores from the saved
logsumexp). Kept for comparison (`RL_V4_ATTENTION_BWD=triton_one_pass`): the default is the
two-pass `triton_bwd2.py`, 2.3x faster at V4-Flash dims. The tile timing (`Tiles`) and the operand
preparation (`_operands`) here serve both.

A program takes one token's (padded) heads, as the forward does, and walks the same keys in
BLOCK_N tiles (sliding window, then HCA's prefix or CSA's gathered picks). Per tile, with
p = exp(s - lse) and ds = p * (dO.v - delta) * scale, where delta = dO.O per (token, head):
dq += ds @ k; the tile's keys get ds^T @ q + p^T @ dO (K = V, one head shared by all heads),
summed over heads inside the MMA and added atomically into fp32 dkv / dcomp rows (a key is
seen by up to `window` tokens, a CSA entry by any token that picked it; duplicate picks add
twice, as in the forward). The sink has no value: d sink = -sum p_sink * delta, written per
(token, head) and summed in torch. head_dim 512 makes a (heads x D) fp32 dq too large for one
program's registers, so D / DV programs per token each own DV channels of dq and of the key
gradients and recompute the full-D s and dO.v. Nothing of size (heads x S x keys) is stored.
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from rl.models.v4_attention.triton_fwd import _window_keys


@triton.jit
def _probs(q, do, rows, ok, offs_d, lse, delta, scale):
    # p = exp(s - lse) and ds = p * (dO.v - delta) * scale of a key tile, (H, N) fp32, 0 where
    # a key does not count. rows: (BLOCK_N,) pointers to each key's first channel in kv or
    # comp; ok: which keys count; q, do: (H, D).
    k = tl.load(rows[None, :] + offs_d[:, None], mask=ok[None, :], other=0.0)  # (D, N)
    s = tl.dot(q, k) * scale  # (H, N) fp32
    p = tl.where(ok[None, :], tl.exp(s - lse[:, None]), 0.0)
    ds = p * (tl.dot(do, k) - delta[:, None]) * scale
    return p, ds


@triton.jit
def _key_grads(p, ds, qv, dov, rows, drows, ok, offs_dv, dq):
    # dq += ds @ v; each key's ds^T @ q + p^T @ dO added atomically into its fp32 gradient row
    # (drows: (BLOCK_N,) pointers to its first channel). qv, dov: (H, DV) slices of q, dO.
    v = tl.load(rows[:, None] + offs_dv[None, :], mask=ok[:, None], other=0.0)  # (N, DV)
    dq = tl.dot(ds.to(v.dtype), v, dq)
    dkv = tl.dot(tl.trans(ds.to(qv.dtype)), qv)
    dkv = tl.dot(tl.trans(p.to(dov.dtype)), dov, dkv)  # (N, DV) fp32
    tl.atomic_add(drows[:, None] + offs_dv[None, :], dkv, mask=ok[:, None], sem="relaxed")
    return dq


@triton.jit
def _tile(q, do, qv, dov, rows, drows, ok, offs_d, offs_dv, lse, delta, dq, scale):
    # One key tile, scores recomputed: `_probs`, then `_key_grads`.
    p, ds = _probs(q, do, rows, ok, offs_d, lse, delta, scale)
    return _key_grads(p, ds, qv, dov, rows, drows, ok, offs_dv, dq)


@triton.jit
def _v4_attn_bwd(q_ptr, o_ptr, do_ptr, kv_ptr, comp_ptr, topk_ptr, thr_ptr, valid_ptr,
                 sinks_ptr, lse_ptr, dq_ptr, dkv_ptr, dcomp_ptr, dsink_ptr,
                 S, T, H, K, window, scale, t_stride, sq_b, sq_h, sq_s, so_b, so_h, so_s,
                 MODE: tl.constexpr, HAS_VALID: tl.constexpr, D: tl.constexpr,
                 DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    # o, do and dq share one layout (so_*); q has its own (sq_*). Programs launched together
    # take tokens t_stride (>= window, coprime with S) apart: their windows do not overlap, so
    # their atomic adds into dkv do not queue on the same rows.
    t = (tl.program_id(0).to(tl.int64) * t_stride) % S  # int64: t * sq_s passes 2**31
    n_split: tl.constexpr = D // DV
    b = (tl.program_id(1) // n_split).to(tl.int64)
    dv0 = (tl.program_id(1) % n_split) * DV
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    offs_dv = dv0 + tl.arange(0, DV)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h[:, None] < H
    q_row = q_ptr + b * sq_b + t * sq_s + offs_h[:, None] * sq_h
    o_row = b * so_b + t * so_s + offs_h[:, None] * so_h
    q = tl.load(q_row + offs_d[None, :], mask=h_ok, other=0.0)
    do = tl.load(do_ptr + o_row + offs_d[None, :], mask=h_ok, other=0.0)
    o = tl.load(o_ptr + o_row + offs_d[None, :], mask=h_ok, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)  # (H,)
    qv = tl.load(q_row + offs_dv[None, :], mask=h_ok, other=0.0)
    dov = tl.load(do_ptr + o_row + offs_dv[None, :], mask=h_ok, other=0.0)
    lse_at = (b * S + t) * H + offs_h
    # padded heads: lse = inf makes their p (and so every gradient term) 0
    lse = tl.load(lse_ptr + lse_at, mask=offs_h < H, other=float("inf"))
    sink = tl.load(sinks_ptr + offs_h, mask=offs_h < H, other=0.0)
    if dv0 == 0:
        tl.store(dsink_ptr + lse_at, -tl.exp(sink - lse) * delta, mask=offs_h < H)
    dq = tl.zeros((BLOCK_H, DV), tl.float32)
    # sliding window: keys t - window + 1 .. t
    for n0 in range(0, window, BLOCK_N):
        j, ok = _window_keys(t, n0, offs_n, window, valid_ptr + b * S, HAS_VALID)
        at = (b * S + j) * D
        dq = _tile(q, do, qv, dov, kv_ptr + at, dkv_ptr + at, ok, offs_d, offs_dv, lse, delta,
                   dq, scale)
    if MODE == 1:  # CSA: the indexer's picks (-1 = none)
        for n0 in range(0, K, BLOCK_N):
            idx = tl.load(topk_ptr + (b * S + t) * K + n0 + offs_n, mask=n0 + offs_n < K,
                          other=-1)
            at = (b * T + idx) * D
            dq = _tile(q, do, qv, dov, comp_ptr + at, dcomp_ptr + at, idx >= 0, offs_d,
                       offs_dv, lse, delta, dq, scale)
    if MODE == 2:  # HCA: entries 0 .. thr - 1
        n_vis = tl.minimum(tl.load(thr_ptr + b * S + t), T)
        for n0 in range(0, n_vis, BLOCK_N):
            at = (b * T + n0 + offs_n) * D
            dq = _tile(q, do, qv, dov, comp_ptr + at, dcomp_ptr + at, n0 + offs_n < n_vis,
                       offs_d, offs_dv, lse, delta, dq, scale)
    tl.store(dq_ptr + o_row + offs_dv[None, :], dq.to(dq_ptr.dtype.element_ty), mask=h_ok)


class NoTileFits(RuntimeError):
    """No tile config of the backward fits the device (shared memory)."""


_TOO_BIG = tuple(getattr(triton.runtime.errors, n) for n in ("OutOfResources", "PTXASError")
                 if hasattr(triton.runtime.errors, n))


class Tiles:
    """One kernel's tile configs per (head_dim, padded heads, dtype): pinned by the env var
    `env`, else the candidates that fit timed on the first launch on a GPU (a few seconds of
    compiling, once per process) and the fastest kept for every later call and layer kind; the
    fallbacks are tried in order only if no candidate fits the device's shared memory. A config
    is a tuple of `fields`: BLOCK_N, DV (where the kernel splits head_dim), num_warps,
    num_stages; `max_block_n` bounds BLOCK_N where the kernel needs it."""

    def __init__(self, env: str, fields: tuple[str, ...],
                 candidates: Sequence[tuple[int, ...]], fallback: Sequence[tuple[int, ...]],
                 max_block_n: int | None = None):
        self.env, self.fields, self.max_block_n = env, fields, max_block_n
        self.candidates, self.fallback = candidates, fallback
        self.tuned: dict[tuple, tuple[int, ...]] = {}
        """(head_dim, padded heads, dtype) -> the tiles in use; benchmarks report it."""
        self.timings: dict[tuple, dict[tuple, float]] = {}
        """(head_dim, padded heads, dtype) -> {tiles: ms} of the candidates that fit, if timed."""

    def __call__(self, key, launch) -> tuple[int, ...]:
        if key in self.tuned:
            return self.tuned[key]
        D = key[0]
        pinned = os.environ.get(self.env)
        if pinned:
            self.tuned[key] = self._parse(pinned, D)
            return self.tuned[key]
        fits = [c for c in [*self.candidates, *self.fallback] if self._ok(c, D)]
        if os.environ.get("TRITON_INTERPRET") == "1" or not fits:
            small = dict(BLOCK_N=16, DV=min(D, 64), num_warps=4, num_stages=1)
            self.tuned[key] = tuple(small[f] for f in self.fields)
            return self.tuned[key]
        from triton.testing import do_bench
        times: dict[tuple[int, ...], float] = {}
        for config in fits:
            if config in self.fallback and times:
                break
            try:
                times[config] = do_bench(lambda c=config: launch(c), warmup=5, rep=20)
            except _TOO_BIG:
                continue
        if not times:
            raise NoTileFits(f"no Triton backward tile config fits head_dim {D} in {key[2]}")
        self.tuned[key], self.timings[key] = min(times, key=lambda c: times[c]), times
        return self.tuned[key]

    def _ok(self, config: tuple[int, ...], head_dim: int) -> bool:
        if len(config) != len(self.fields):
            return False
        c = dict(zip(self.fields, config))
        dv = c.get("DV", head_dim)
        return (16 <= c["BLOCK_N"] <= (self.max_block_n or c["BLOCK_N"]) and c["num_warps"] > 0
                and 16 <= dv <= head_dim and head_dim % dv == 0)

    def _parse(self, text: str, head_dim: int) -> tuple[int, ...]:
        try:
            config = tuple(int(x) for x in text.split(","))
        except ValueError:
            config = ()
        if not self._ok(config, head_dim):
            rules = ["BLOCK_N >= 16" + (f" and <= {self.max_block_n}" if self.max_block_n
                                        else "")]
            if "DV" in self.fields:
                rules.append(f"DV >= 16 dividing head_dim {head_dim}")
            raise ValueError(f"{self.env}={text!r}: expected {','.join(self.fields)} "
                             f"({', '.join(rules)})")
        return config


TILES_ENV = "RL_V4_ATTENTION_BWD_TILES"
"""`BLOCK_N,DV,num_warps,num_stages` pins the backward's tiles (skips the timing)."""
CANDIDATES = [(16, 256, 8, 1), (32, 256, 8, 1), (32, 128, 8, 1), (32, 128, 8, 2)]
"""(BLOCK_N, DV, num_warps, num_stages) timed on the first backward of a (head_dim, heads, dtype)
on a GPU; the fastest stays. Larger DV: fewer programs recompute s and dO.v; larger BLOCK_N:
larger MMAs; both cost shared memory (q and dO, (heads x D) each, stay resident)."""
FALLBACK = [(16, 128, 8, 1), (16, 64, 4, 1)]
"""Tried in order only if no candidate fits the device's shared memory."""
TILES = Tiles(TILES_ENV, ("BLOCK_N", "DV", "num_warps", "num_stages"), CANDIDATES, FALLBACK)
TUNED = TILES.tuned
TIMINGS = TILES.timings


def v4_attention_bwd(grad_BHSD, q_BHSD, kv_BSD, comp_BTD, topk_BSK, thr_BS, valid_BS, sinks_H,
                     out_BHSD, lse_BSH, scale, window, tiles=None):
    """(dq, dkv, dcomp or None, dsinks) of `chunked.v4_attention` (same arguments) given the
    output's gradient, the forward's output and its logsumexp (`v4_attention_fwd(...,
    return_lse=True)`). Gradients come back in their inputs' dtypes, summed in fp32."""
    B, H, S, D = q_BHSD.shape
    grad, q, out, kv, comp, topk, thr, valid, mode = _operands(
        grad_BHSD, q_BHSD, out_BHSD, kv_BSD, comp_BTD, topk_BSK, thr_BS, valid_BS)
    T = comp.shape[1]
    dq = torch.empty_like(out, dtype=q.dtype)
    dkv = torch.zeros(B, S, D, dtype=torch.float32, device=kv.device)
    dcomp = torch.zeros(B, T, D, dtype=torch.float32, device=kv.device)
    dsink = torch.empty(B, S, H, dtype=torch.float32, device=kv.device)
    args = (q, out, grad, kv, comp, topk, thr, valid, sinks_H.float().contiguous(),
            lse_BSH.contiguous(), dq, dkv, dcomp, dsink, S, T, H,
            topk.shape[-1] if mode == 1 else 0, window, scale, _coprime_stride(window, S),
            q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2))
    meta = dict(MODE=mode, HAS_VALID=valid_BS is not None, D=D,
                BLOCK_H=max(16, triton.next_power_of_2(H)))

    def launch(config):
        block_n, dv, warps, stages = config
        dkv.zero_()
        dcomp.zero_()
        _v4_attn_bwd[(S, B * (D // dv))](*args, DV=dv, BLOCK_N=block_n, num_warps=warps,
                                         num_stages=stages, **meta)

    launch(tiles or TILES((D, meta["BLOCK_H"], q.dtype), launch))
    return (dq, dkv.to(kv_BSD.dtype), None if comp_BTD is None else dcomp.to(comp_BTD.dtype),
            dsink.sum((0, 1)).to(sinks_H.dtype))


def _operands(grad_BHSD, q_BHSD, out_BHSD, kv_BSD, comp_BTD, topk_BSK, thr_BS, valid_BS):
    """(grad, q, out, kv, comp, topk, thr, valid, mode) as the backward kernels take them: the
    head dim contiguous, grad in out's layout (o, dO and dq share strides), int32 thresholds,
    int8 padding, placeholders where the layer kind has none; mode 0 sliding, 1 CSA, 2 HCA."""
    B, D = q_BHSD.shape[0], q_BHSD.shape[3]
    q = q_BHSD if q_BHSD.stride(3) == 1 else q_BHSD.contiguous()
    out = out_BHSD if out_BHSD.stride(3) == 1 else out_BHSD.contiguous()
    grad = grad_BHSD if grad_BHSD.stride() == out.stride() else (
        torch.empty_like(out).copy_(grad_BHSD))
    kv = kv_BSD.contiguous()
    mode = 1 if topk_BSK is not None else 2 if thr_BS is not None else 0
    comp = comp_BTD.contiguous() if comp_BTD is not None else kv.new_zeros(B, 1, D)
    topk = topk_BSK.contiguous() if mode == 1 else kv.new_zeros(1, dtype=torch.long)
    thr = thr_BS.to(torch.int32).contiguous() if mode == 2 else kv.new_zeros(1, dtype=torch.int32)
    valid = valid_BS.to(torch.int8).contiguous() if valid_BS is not None else thr
    return grad, q, out, kv, comp, topk, thr, valid, mode


def _coprime_stride(window: int, S: int) -> int:
    stride = max(window, 1)
    while math.gcd(stride, S) != 1:
        stride += 1
    return stride

"""Which implementation of `v4_attention` runs, and which backward the Triton path takes.

On a CUDA device with Triton: the Triton forward (`triton_fwd.py`), which also saves each
softmax row's logsumexp, and the two-pass Triton backward (`triton_bwd2.py`: each token's scores
once into chunked buffers, then the gradients; memory O(S)). RL_V4_ATTENTION_BWD=triton_one_pass
takes the one-pass Triton backward instead (`triton_bwd.py`: the scores recomputed in each of a
token's D / DV programs, 2.3x slower at V4-Flash dims; kept for comparison), and
RL_V4_ATTENTION_BWD=torch recomputes each query block's scores in torch
(`chunked._block_attention`) and back-propagates through that block alone (memory O(block x
keys)).
Elsewhere: the chunked torch path, whose blocks are checkpointed (the same recompute-per-block
backward, via autograd).
"""
from __future__ import annotations

import os
import warnings

import torch

from rl.models.v4_attention import chunked

FORCE = os.environ.get("RL_V4_ATTENTION", "")
""""torch" or "triton" overrides the choice by device (benchmarks, tests)."""
BACKWARD = os.environ.get("RL_V4_ATTENTION_BWD", "triton")
""""triton" (default: two-pass), "triton_one_pass" or "torch": the Triton path's backward
(benchmarks compare them)."""


def _use_triton(q: torch.Tensor) -> bool:
    if FORCE:
        return FORCE == "triton"
    if not q.is_cuda:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class _TritonAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, kv, comp, sinks, topk, thr, valid, scale, window):
        from rl.models.v4_attention.triton_fwd import v4_attention_fwd
        if BACKWARD not in ("triton", "triton_one_pass", "torch"):
            raise ValueError(f"RL_V4_ATTENTION_BWD={BACKWARD!r}: expected triton, "
                             "triton_one_pass or torch")
        ctx.scale, ctx.window, ctx.two_pass = scale, window, BACKWARD == "triton"
        ctx.flash = BACKWARD != "torch" and any(ctx.needs_input_grad)
        if not ctx.flash:
            ctx.save_for_backward(q, kv, comp, sinks, topk, thr, valid)
            return v4_attention_fwd(q, kv, comp, topk, thr, valid, sinks, scale, window)
        out, lse = v4_attention_fwd(q, kv, comp, topk, thr, valid, sinks, scale, window,
                                    return_lse=True)
        # the output too (one more q-sized tensor): delta = dO.O needs it
        ctx.save_for_backward(q, kv, comp, sinks, topk, thr, valid, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        grads = None
        if ctx.flash:
            from rl.models.v4_attention.triton_bwd import NoTileFits, v4_attention_bwd
            from rl.models.v4_attention.triton_bwd2 import v4_attention_bwd2
            q, kv, comp, sinks, topk, thr, valid, out, lse = saved
            bwd = v4_attention_bwd2 if ctx.two_pass else v4_attention_bwd
            try:
                grads = bwd(grad_out, q, kv, comp, topk, thr, valid, sinks, out, lse, ctx.scale,
                            ctx.window)
            except NoTileFits as e:  # e.g. fp32 at head_dim 512 on a small-smem GPU
                warnings.warn(f"{e}: this backward recomputes in torch instead", stacklevel=2)
        if grads is None:
            grads = _torch_backward(saved[:7], grad_out, ctx.scale, ctx.window)
        dq, dkv, dcomp, dsinks = grads
        return dq, dkv, dcomp, dsinks, None, None, None, None, None


def _torch_backward(saved, grad_out, scale, window):
    """(dq, dkv, dcomp, dsinks): each query block's scores recomputed in torch, through autograd."""
    q, kv, comp, sinks, topk, thr, valid = saved
    leaves = [t.detach().requires_grad_() if t is not None else None
              for t in (kv, comp, sinks)]
    kv_, comp_, sinks_ = leaves
    dq = torch.empty_like(q)
    sums = [None, None, None]
    block = chunked.QUERY_BLOCK
    for q0 in range(0, q.shape[2], block):
        q1 = min(q0 + block, q.shape[2])
        with torch.enable_grad():
            qb = q[:, :, q0:q1].detach().requires_grad_()
            out = chunked._block_attention(
                qb, kv_, comp_, None if topk is None else topk[:, q0:q1],
                None if thr is None else thr[:, q0:q1], valid, sinks_, q0, scale, window)
            wrt = [qb] + [t for t in leaves if t is not None]
            grads = torch.autograd.grad(out, wrt, grad_out[:, :, q0:q1], allow_unused=True)
        dq[:, :, q0:q1] = grads[0]
        rest = iter(grads[1:])
        for i, leaf in enumerate(leaves):
            if leaf is None:
                continue
            g = next(rest)
            if g is not None:
                sums[i] = g.float() if sums[i] is None else sums[i].add_(g)
    dkv, dcomp, dsinks = [None if s is None else s.to(t.dtype)
                          for s, t in zip(sums, (kv, comp, sinks))]
    return dq, dkv, dcomp, dsinks


def attention(q_BHSD, kv_BSD, comp_BTD, topk_BSK, thr_BS, valid_BS, sinks_H, scale, window):
    """`chunked.v4_attention` (see there for the arguments), on the fastest path for the device."""
    if _use_triton(q_BHSD):
        return _TritonAttention.apply(q_BHSD, kv_BSD, comp_BTD, sinks_H, topk_BSK, thr_BS,
                                      valid_BS, scale, window)
    return chunked.v4_attention(q_BHSD, kv_BSD, comp_BTD, topk_BSK, thr_BS, valid_BS, sinks_H,
                                scale, window)

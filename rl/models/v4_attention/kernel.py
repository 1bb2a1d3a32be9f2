"""Which implementation of `v4_attention` runs, and the Triton path's backward.

On a CUDA device with Triton: the Triton forward (`triton_fwd.py`), and a backward that
recomputes each query block's scores in torch (`chunked._block_attention`) and back-propagates
through that block alone, so memory stays O(block x keys). Elsewhere: the chunked torch path,
whose blocks are checkpointed (the same recompute-per-block backward, via autograd).
"""
from __future__ import annotations

import os

import torch

from rl.models.v4_attention import chunked

FORCE = os.environ.get("RL_V4_ATTENTION", "")
""""torch" or "triton" overrides the choice by device (benchmarks, tests)."""


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
        ctx.save_for_backward(q, kv, comp, sinks, topk, thr, valid)
        ctx.scale, ctx.window = scale, window
        return v4_attention_fwd(q, kv, comp, topk, thr, valid, sinks, scale, window)

    @staticmethod
    def backward(ctx, grad_out):
        q, kv, comp, sinks, topk, thr, valid = ctx.saved_tensors
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
                    None if thr is None else thr[:, q0:q1], valid, sinks_, q0, ctx.scale,
                    ctx.window)
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
        return dq, dkv, dcomp, dsinks, None, None, None, None, None


def attention(q_BHSD, kv_BSD, comp_BTD, topk_BSK, thr_BS, valid_BS, sinks_H, scale, window):
    """`chunked.v4_attention` (see there for the arguments), on the fastest path for the device."""
    if _use_triton(q_BHSD):
        return _TritonAttention.apply(q_BHSD, kv_BSD, comp_BTD, sinks_H, topk_BSK, thr_BS,
                                      valid_BS, scale, window)
    return chunked.v4_attention(q_BHSD, kv_BSD, comp_BTD, topk_BSK, thr_BS, valid_BS, sinks_H,
                                scale, window)

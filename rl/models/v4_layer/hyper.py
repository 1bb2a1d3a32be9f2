"""DeepSeek-V4's hyper-connections (mHC) and RMSNorm as whole functions, one compiled graph each.

Where transformers' eager layer spends its time (`bench/results/v4_layer.md`, 8,192 tokens,
V4-Flash dims; 4 mixers in two layers): each mixer's Sinkhorn projection of the (4 x 4) `comb`
matrix runs 20 iterations of sum / add / divide on (tokens, 4, 4) tensors, ~120 kernel launches
forward and ~240 backward for a few kilobytes of work each; ~460 launches per mixer in all
(counted with a dispatch mode on CPU). Each mix back into the streams, `matmul(comb^T,
streams)`, is a batched GEMM of (4 x 4) @ (4 x 4096) per token, once forward and twice backward:
12 calls in the profiled step, which match its 11 `cutlass_80_wmma` `bmm` kernels of ~2 ms
(~21 ms; the other ~1,550 `bmm` calls, ~50 us each, are the attention's per-block backward).
Around them, casts and products of the (tokens, 4, 4096) streams in fp32 each make a full pass
over 256-512 MB.

Here each piece is one function of plain torch ops: `hc_pre` (norm, projection, sigmoid /
softmax, Sinkhorn, collapse), `hc_post` (expand and mix; for the MoE it also adds the shared
expert to the routed output), `hc_head` (the final collapse) and `rms_norm`. On CUDA they run
under `torch.compile(fullgraph=True)` (`compiled.py`): inductor unrolls the size-4 reductions,
so the Sinkhorn loop and the mix become a few fused Triton kernels forward and backward.
torch.compile rather than hand-written Triton: the backward of 20 Sinkhorn iterations comes
from AOTAutograd, exact, instead of a hand derivation, and the same source is the CPU path. The
mix is written as an unrolled sum over the 4 input streams, not `einsum` / `matmul`: those
lower to the small batched GEMM above, which inductor hands to cuBLAS as it is.

Precision: the norm, projection, Sinkhorn and collapse in fp32 (as transformers: its mixers are
fp32 modules), and the expand + mix in fp32 from `post` / `comb` in fp32, rounded once to the
streams' dtype, as vLLM's reference for V4 does (`mhc_post_torch` in
`vllm/model_executor/kernels/mhc/torch.py`). transformers rounds `post` and `comb` to bf16 first
and mixes in bf16; in fp32 the two are the same function, in bf16 ours is at least as close to
an fp32 computation (tests/rl/models/test_v4_layer.py checks both). The RMSNorm is
`rl.models.v4_precision`'s: fp32 inside, the input's dtype out.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rl.models.v4_layer.compiled import Fused


def _sinkhorn(comb_TNN: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    # DeepseekV4HyperConnection.forward's projection onto doubly stochastic matrices
    comb_TNN = comb_TNN / (comb_TNN.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb_TNN = comb_TNN / (comb_TNN.sum(dim=-1, keepdim=True) + eps)
        comb_TNN = comb_TNN / (comb_TNN.sum(dim=-2, keepdim=True) + eps)
    return comb_TNN


def _collapse(pre_TN: torch.Tensor, h_TND: torch.Tensor) -> torch.Tensor:
    # sum_j pre[j] * h[j] in fp32 (pre is fp32), rounded once to the streams' dtype
    return (pre_TN.unsqueeze(-1) * h_TND).sum(dim=1).to(h_TND.dtype)


def _hc_pre(h_TND: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            norm_eps: float, hc_eps: float, iters: int):
    num_tokens, n = h_TND.shape[:2]
    x = h_TND.reshape(num_tokens, -1).float()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    mixes = F.linear(x, fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(num_tokens, n, n) * scale[2] + comb_b.view(n, n), dim=-1)
    comb = _sinkhorn(comb + hc_eps, iters, hc_eps)
    return post, comb, _collapse(pre, h_TND)


def _hc_head(h_TND: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
             norm_eps: float, hc_eps: float) -> torch.Tensor:
    x = h_TND.reshape(h_TND.shape[0], -1).float()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(F.linear(x, fn.float()) * scale.float() + base.float()) + hc_eps
    return _collapse(pre, h_TND)


def _hc_post(h_TND: torch.Tensor, post_TN: torch.Tensor, comb_TNN: torch.Tensor,
             *outs_TD: torch.Tensor) -> torch.Tensor:
    # out[n] = post[n] * block_output + sum_j comb[j, n] * h[j]; block_output = sum of outs_TD
    # (the MoE's routed and shared parts)
    # (all in fp32 or wider: a float64 model stays float64, as transformers' does)
    wide = torch.promote_types(h_TND.dtype, torch.float32)
    x = outs_TD[0].to(wide)
    for o in outs_TD[1:]:
        x = x + o.to(wide)
    out = post_TN.to(wide).unsqueeze(-1) * x.unsqueeze(1)
    if not torch.compiler.is_compiling():  # eagerly one batched GEMM beats N passes
        return (out + torch.matmul(comb_TNN.to(wide).transpose(-1, -2), h_TND.to(wide))
                ).to(h_TND.dtype)
    for j in range(h_TND.shape[1]):  # compiled: one fused pass (see the module docstring)
        out = out + comb_TNN[:, j, :, None].to(wide) * h_TND[:, j, None, :].to(wide)
    return out.to(h_TND.dtype)


def _rms_norm(x_TD: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x_TD.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * x).to(x_TD.dtype)


hc_pre = Fused(_hc_pre, token_args=1)
"""(h (T, N, D), fn (N*(N+2), N*D), base, scale (3,), norm_eps, hc_eps, sinkhorn iters) ->
post (T, N) fp32, comb (T, N, N) fp32 (comb[j, n]: input stream j into output stream n),
collapsed (T, D) in h's dtype."""
hc_head = Fused(_hc_head, token_args=1)
"""(h (T, N, D), fn (N, N*D), base (N,), scale (1,), norm_eps, hc_eps) -> collapsed (T, D)."""
hc_post = Fused(_hc_post, token_args=5)
"""(h (T, N, D), post (T, N), comb (T, N, N), *outputs (T, D)) -> streams (T, N, D), h's dtype."""
rms_norm = Fused(_rms_norm, token_args=1)
"""(x (T, D), weight (D,), eps) -> (T, D) in x's dtype, computed in fp32."""

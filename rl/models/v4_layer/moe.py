"""DeepSeek-V4's routed experts: one sort, one grouped GEMM per projection, no scatter-add.

`experts_forward` is registered with transformers as the experts implementation `IMPLEMENTATION`
(`install` in this package), so it runs inside the experts module's own forward (DeepSpeed
ZeRO-3 gathers the expert weights on that call) and under `rl.trainer.expert_parallel`, whose
ranks call the same module on the pairs they received.

For T tokens and top-k K (P = T * K (token, expert) pairs):
1. `order` = the pairs sorted by expert (one stable sort), `inverse` its inverse permutation,
   the grouped GEMM offsets by a binary search in the sorted ids (no host sync).
2. `_Dispatch`: x[order // K], the tokens in expert order (P, H); its backward gathers the
   pairs' gradients back through `inverse` and sums each token's K rows (`gather_sum`).
3. gate_up and down as one grouped GEMM each (`torch.nn.functional.grouped_mm` on CUDA, the op
   transformers' `grouped_mm` experts call; a per-expert loop elsewhere, or when DeepSpeed's
   flat buffer leaves a weight off the 16-byte alignment the CUDA kernel needs), the clamped
   SwiGLU between them one fused function (`swiglu`).
4. `_Combine`: y[inverse] viewed as (T, K, H), times the routing weights, summed over K
   (`weighted_sum`); its backward gathers through `order` (`weighted_sum_grads`). The routing
   weights get their gradient here, as in transformers.

The gathers, products and sums of steps 2-4 are `compiled.Fused` functions: on CUDA each is one
inductor kernel reading the gathered rows once (no (T, K, H) intermediate), eagerly elsewhere
with transformers' op order (bf16 products rounded before the sum, as its `grouped_mm` path).

transformers' `grouped_mm` path does steps 1-4 with advanced indexing, whose backward is an
`index_put_(accumulate=True)` (a sort and a scatter-add per use, twice per layer); its eager
path adds each expert's rows with `index_add_`. Both gathers here are permutations, so each
backward is another gather, and the only reductions are sums over K.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from rl.models.v4_layer.compiled import Fused

log = logging.getLogger(__name__)
IMPLEMENTATION = "rl_v4_grouped"
"""The name of `experts_forward` among transformers' experts implementations."""
_warned = False


def _gather_sum(grad_PH: torch.Tensor, inverse_P: torch.Tensor, top_k: int) -> torch.Tensor:
    # (T, H): each token's K rows, gathered from expert order and summed
    rows = grad_PH.index_select(0, inverse_P)
    return rows.view(-1, top_k, grad_PH.shape[-1]).sum(dim=1)


def _weighted_sum(y_PH: torch.Tensor, inverse_P: torch.Tensor, w_TK: torch.Tensor):
    # (T, H): sum_k w[t, k] * y[inverse[t * K + k]]
    rows = y_PH.index_select(0, inverse_P).view(*w_TK.shape, y_PH.shape[-1])
    return (rows * w_TK.unsqueeze(-1)).sum(dim=1)


def _weighted_sum_grads(grad_TH: torch.Tensor, y_PH: torch.Tensor, inverse_P: torch.Tensor,
                        order_P: torch.Tensor, w_TK: torch.Tensor):
    # d y (P, H) in expert order: g[token of pair] * its weight; d w (T, K): <g[t], y[pair]>
    top_k = w_TK.shape[1]
    rows = y_PH.index_select(0, inverse_P).view(*w_TK.shape, y_PH.shape[-1])
    grad_w = (grad_TH.unsqueeze(1) * rows).sum(dim=-1).to(w_TK.dtype)
    pair_w = w_TK.reshape(-1).index_select(0, order_P).unsqueeze(-1)
    grad_y = (grad_TH.index_select(0, order_P // top_k) * pair_w).to(y_PH.dtype)
    return grad_y, grad_w


gather_sum = Fused(_gather_sum, token_args=2)
weighted_sum = Fused(_weighted_sum, token_args=3)
weighted_sum_grads = Fused(_weighted_sum_grads, token_args=5)


class _Dispatch(torch.autograd.Function):
    """x (T, H) -> x[order // K] (P, H); backward: g[inverse] (T, K, H) summed over K."""

    @staticmethod
    def forward(ctx, x, order, inverse, top_k: int):
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        return x.index_select(0, order // top_k)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return gather_sum(grad, inverse, ctx.top_k), None, None, None


class _Combine(torch.autograd.Function):
    """y (P, H) in expert order, w (T, K) -> sum_k w[t, k] * y[inverse[t * K + k]] (T, H)."""

    @staticmethod
    def forward(ctx, y, weights, order, inverse):
        ctx.save_for_backward(y, weights, order, inverse)
        return weighted_sum(y, inverse, weights)

    @staticmethod
    def backward(ctx, grad):
        y, weights, order, inverse = ctx.saved_tensors
        grad_y, grad_w = weighted_sum_grads(grad.contiguous(), y, inverse, order, weights)
        return (grad_y if ctx.needs_input_grad[0] else None,
                grad_w if ctx.needs_input_grad[1] else None, None, None)


class _LoopGroupedMM(torch.autograd.Function):
    """x (P, I) @ w[e] (I, O) for the rows of each expert e, one matmul per expert."""

    @staticmethod
    def forward(ctx, x, w, counts):
        ctx.save_for_backward(x, w)
        ctx.counts = counts
        out = x.new_empty((x.shape[0], w.shape[-1]))
        for e, (rows, dst) in enumerate(zip(x.split(counts), out.split(counts))):
            if rows.shape[0]:
                torch.mm(rows, w[e], out=dst)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad_x = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(w) if ctx.needs_input_grad[1] else None
        start = 0
        for e, n in enumerate(ctx.counts):
            if n:
                g = grad[start:start + n]
                if grad_x is not None:
                    torch.mm(g, w[e].t(), out=grad_x[start:start + n])
                if grad_w is not None:
                    torch.mm(x[start:start + n].t(), g, out=grad_w[e])
            start += n
        return grad_x, grad_w, None


def aligned(*tensors: torch.Tensor) -> bool:
    """Every data pointer 16-byte aligned (what the CUDA grouped GEMM requires)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


# torch >= 2.10 names it F.grouped_mm; 2.9 has only the private op (transformers does the same)
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _kernel_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    global _warned
    if not (x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 0)):
        return False
    if aligned(x, w):
        return True
    if not _warned:
        _warned = True
        log.warning("expert weights are not 16-byte aligned (a view into DeepSpeed's flat "
                    "buffer): those grouped GEMMs run as one matmul per expert")
    return False


def grouped_mm(x_PI: torch.Tensor, w_EIO: torch.Tensor, offsets_E: torch.Tensor
               ) -> torch.Tensor:
    """Rows [offsets[e-1], offsets[e]) of x times w[e]: (P, O). offsets int32 cumulative."""
    x_PI = x_PI.to(w_EIO.dtype)
    if _GROUPED_MM is not None and _kernel_ok(x_PI, w_EIO):
        return _GROUPED_MM(x_PI, w_EIO, offs=offsets_E)
    counts = offsets_E.diff(prepend=offsets_E.new_zeros(1))
    return _LoopGroupedMM.apply(x_PI, w_EIO, counts.tolist())


def _swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def _swiglu_pair(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


swiglu = Fused(_swiglu, token_args=1)
"""DeepseekV4Experts._apply_gate: (P, 2I) [gate | up] -> silu(clamp(gate)) * clamp(up) (P, I)."""
swiglu_pair = Fused(_swiglu_pair, token_args=2)
"""DeepseekV4MLP's activation on separate gate and up (T, I)."""


def experts_forward(self, hidden_TH: torch.Tensor, top_k_index_TK: torch.Tensor,
                    top_k_weights_TK: torch.Tensor) -> torch.Tensor:
    """transformers' experts-implementation signature: (T, H) tokens, (T, K) expert ids and
    routing weights -> (T, H) the weighted sum of each token's experts, in the tokens' dtype."""
    if getattr(self, "_is_expert_parallel", False):
        raise NotImplementedError(f"{IMPLEMENTATION} does not take transformers' expert-parallel "
                                  "sentinels; the project's is rl.trainer.expert_parallel")
    top_k = top_k_index_TK.shape[-1]
    experts, order = torch.sort(top_k_index_TK.reshape(-1), stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    # offsets[e] = pairs with expert <= e: no host sync (bincount would read the max id back)
    ids = torch.arange(self.num_experts, device=experts.device, dtype=experts.dtype)
    offsets = torch.searchsorted(experts, ids, right=True).to(torch.int32)
    x = _Dispatch.apply(hidden_TH, order, inverse, top_k)
    h = grouped_mm(x, self.gate_up_proj.transpose(-2, -1), offsets)
    h = swiglu(h, self.limit)
    y = grouped_mm(h, self.down_proj.transpose(-2, -1), offsets)
    return _Combine.apply(y, top_k_weights_TK, order, inverse).to(hidden_TH.dtype)

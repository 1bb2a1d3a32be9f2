"""DeepSeek-V4's routed experts: one sort, one grouped GEMM per projection, no scatter-add.

`experts_forward` is registered with transformers as the experts implementation `IMPLEMENTATION`
(`install` in this package), so it runs inside the experts module's own forward (DeepSpeed
ZeRO-3 gathers the expert weights on that call) and under `rl.trainer.expert_parallel`, whose
ranks call the same module on the pairs they received.

For T tokens and top-k K (P = T * K (token, expert) pairs):
1. `order` = the pairs sorted by expert (one stable argsort), `inverse` its inverse permutation,
   per-expert counts -> the grouped GEMM offsets.
2. `_Dispatch`: x[order // K], the tokens in expert order (P, H); its backward gathers the
   pairs' gradients back through `inverse` and sums each token's K rows (a reshape and sum).
3. gate_up and down as one grouped GEMM each (`torch.nn.functional.grouped_mm` on CUDA, the op
   transformers' `grouped_mm` experts call; a per-expert loop elsewhere, or when DeepSpeed's
   flat buffer leaves a weight off the 16-byte alignment the CUDA kernel needs), the clamped
   SwiGLU between them one fused function (`swiglu`).
4. `_Combine`: y[inverse] viewed as (T, K, H), times the routing weights, summed over K; its
   backward gathers through `order`. The routing weights get their gradient here, as in
   transformers.

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
        rows = grad.index_select(0, inverse)
        return rows.view(-1, ctx.top_k, grad.shape[-1]).sum(dim=1), None, None, None


class _Combine(torch.autograd.Function):
    """y (P, H) in expert order, w (T, K) -> sum_k w[t, k] * y[inverse[t * K + k]] (T, H)."""

    @staticmethod
    def forward(ctx, y, weights, order, inverse):
        rows = y.index_select(0, inverse).view(*weights.shape, y.shape[-1])  # (T, K, H)
        ctx.save_for_backward(rows, weights, order)
        return (rows * weights.unsqueeze(-1)).sum(dim=1)

    @staticmethod
    def backward(ctx, grad):
        rows, weights, order = ctx.saved_tensors
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_rows = grad.unsqueeze(1) * weights.unsqueeze(-1)
            grad_y = grad_rows.flatten(0, 1).index_select(0, order).to(rows.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (grad.unsqueeze(1) * rows).sum(dim=-1).to(weights.dtype)
        return grad_y, grad_w, None, None


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


def _kernel_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    global _warned
    if not (x.is_cuda and hasattr(F, "grouped_mm")
            and torch.cuda.get_device_capability(x.device) >= (8, 0)):
        return False
    if aligned(x, w):
        return True
    if not _warned:
        _warned = True
        log.warning("expert weights are not 16-byte aligned (a view into DeepSpeed's flat "
                    "buffer): those grouped GEMMs run as one matmul per expert")
    return False


def grouped_mm(x_PI: torch.Tensor, w_EIO: torch.Tensor, offsets_E: torch.Tensor,
               counts_E: torch.Tensor) -> torch.Tensor:
    """Rows [offsets[e-1], offsets[e]) of x times w[e]: (P, O). offsets int32 cumulative."""
    x_PI = x_PI.to(w_EIO.dtype)
    if _kernel_ok(x_PI, w_EIO):
        return F.grouped_mm(x_PI, w_EIO, offs=offsets_E)
    return _LoopGroupedMM.apply(x_PI, w_EIO, counts_E.tolist())


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
    flat = top_k_index_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.bincount(flat, minlength=self.num_experts)
    offsets = counts.cumsum(0, dtype=torch.int32)
    x = _Dispatch.apply(hidden_TH, order, inverse, top_k)
    h = grouped_mm(x, self.gate_up_proj.transpose(-2, -1), offsets, counts)
    h = swiglu(h, self.limit)
    y = grouped_mm(h, self.down_proj.transpose(-2, -1), offsets, counts)
    return _Combine.apply(y, top_k_weights_TK, order, inverse).to(hidden_TH.dtype)

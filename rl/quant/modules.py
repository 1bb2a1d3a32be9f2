"""FP8 drop-in modules for a rollout model, and the swap that installs them.

- `FP8Linear`: replaces `nn.Linear`; holds `weight_fp8` (N, K) e4m3fn and `weight_scale`
  (ceil(N/128), ceil(K/128)) fp32 as buffers (they move with `.to()` and are in the state dict).
- `FP8Experts`: replaces a transformers 5.x fused expert stack (`Qwen3MoeExperts`: parameters
  `gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I)), quantised per expert; the forward
  loops over the experts that received tokens (reference speed, not a grouped kernel).

`load_bf16_weight` re-quantises *in place* (copy_ into the existing buffers) when the trainer
sends new weights, so addresses stay valid for CUDA graphs and nothing is reallocated.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from rl.quant.backends import fp8_linear, select_backend
from rl.quant.block_fp8 import (
    DEFAULT_BLOCK, FP8_DTYPE, dequantize_weight_block, num_blocks, quantize_weight_block,
)
from rl.quant.policy import KeepPolicy, as_policy
from rl.quant.report import error_row


class FP8Linear(nn.Module):
    """`y = x @ deq(weight_fp8, weight_scale).T + bias` through `fp8_linear`.

    `backend` is a resolved backend name ("torch", "cuda", "aiter"). Output dtype = input dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 backend: str = "torch", pow2: bool = False, block: int = DEFAULT_BLOCK,
                 device: torch.device | str | None = None, bias_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.backend, self.pow2, self.block = backend, pow2, block
        nb, kb = num_blocks(out_features, block), num_blocks(in_features, block)
        self.register_buffer("weight_fp8", torch.zeros(out_features, in_features, dtype=FP8_DTYPE,
                                                       device=device))
        self.register_buffer("weight_scale", torch.ones(nb, kb, dtype=torch.float32, device=device))
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device),
                                  requires_grad=False) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: str = "torch", pow2: bool = False,
                    block: int = DEFAULT_BLOCK) -> FP8Linear:
        """Quantise an `nn.Linear` (its weight stays untouched)."""
        module = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                     backend=backend, pow2=pow2, block=block, device=linear.weight.device,
                     bias_dtype=linear.bias.dtype if linear.bias is not None else torch.bfloat16)
        module.load_bf16_weight(linear.weight, linear.bias)
        return module

    @torch.no_grad()
    def load_bf16_weight(self, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Re-quantise from a full-precision weight (N, K) (and bias (N,)), in place."""
        if tuple(w.shape) != tuple(self.weight_fp8.shape):
            raise ValueError(f"FP8Linear.load_bf16_weight: got shape {tuple(w.shape)}, "
                             f"expected {tuple(self.weight_fp8.shape)}")
        w8, scale = quantize_weight_block(w.to(self.weight_fp8.device), self.block, self.pow2)
        self.weight_fp8.copy_(w8)
        self.weight_scale.copy_(scale)
        if bias is not None:
            if self.bias is None:
                raise ValueError("FP8Linear.load_bf16_weight: got a bias for a layer without one")
            self.bias.copy_(bias)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_weight_block(self.weight_fp8, self.weight_scale, self.block, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight_fp8, self.weight_scale, self.bias, self.backend,
                          block=self.block)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, backend={self.backend}, block={self.block}, "
                f"pow2={self.pow2}")


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers 5.x fused expert stack: 3-D `gate_up_proj` (E, 2I, H), `down_proj` (E, H, I)."""
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor)):
        return False
    if gu.dim() != 3 or down.dim() != 3 or getattr(module, "is_transposed", False):
        return False
    e, two_i, h = gu.shape
    return down.shape == (e, h, two_i // 2) and two_i % 2 == 0 and hasattr(module, "act_fn")


class FP8Experts(nn.Module):
    """FP8 version of a fused expert stack with the same forward signature as `Qwen3MoeExperts`.

    Buffers: `gate_up_fp8` (E, 2I, H) + `gate_up_scale` (E, ceil(2I/128), ceil(H/128)),
    `down_fp8` (E, H, I) + `down_scale` (E, ceil(H/128), ceil(I/128)).
    """

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, act_fn: nn.Module,
                 *, backend: str = "torch", pow2: bool = False, block: int = DEFAULT_BLOCK,
                 device: torch.device | str | None = None):
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_dim, intermediate_dim
        self.act_fn, self.backend, self.pow2, self.block = act_fn, backend, pow2, block
        e, h, i = num_experts, hidden_dim, intermediate_dim
        for name, (n, k) in (("gate_up", (2 * i, h)), ("down", (h, i))):
            self.register_buffer(f"{name}_fp8", torch.zeros(e, n, k, dtype=FP8_DTYPE, device=device))
            self.register_buffer(f"{name}_scale", torch.ones(e, num_blocks(n, block), num_blocks(k, block),
                                                             device=device))

    @classmethod
    def from_experts(cls, experts: nn.Module, backend: str = "torch", pow2: bool = False,
                     block: int = DEFAULT_BLOCK) -> FP8Experts:
        if not is_fused_experts(experts):
            raise ValueError(f"FP8Experts.from_experts: {type(experts).__name__} is not a fused "
                             "(E, N, K) expert stack with gate_up_proj / down_proj")
        e, two_i, h = experts.gate_up_proj.shape
        module = cls(e, h, two_i // 2, experts.act_fn, backend=backend, pow2=pow2, block=block,
                     device=experts.gate_up_proj.device)
        module.load_bf16_weight(experts.gate_up_proj, experts.down_proj)
        return module

    @torch.no_grad()
    def load_bf16_weight(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> None:
        """Re-quantise both stacks in place from full-precision (E, N, K) tensors."""
        for name, w in (("gate_up", gate_up_proj), ("down", down_proj)):
            dst = getattr(self, f"{name}_fp8")
            if tuple(w.shape) != tuple(dst.shape):
                raise ValueError(f"FP8Experts.load_bf16_weight: {name} shape {tuple(w.shape)}, "
                                 f"expected {tuple(dst.shape)}")
            w8, scale = quantize_weight_block(w.to(dst.device), self.block, self.pow2)
            dst.copy_(w8)
            getattr(self, f"{name}_scale").copy_(scale)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden_states (T, H); top_k_index / top_k_weights (T, top_k) -> (T, H)."""
        out = torch.zeros_like(hidden_states)
        for e in torch.unique(top_k_index).tolist():
            if not 0 <= e < self.num_experts:  # transformers uses E as a "dropped" marker
                continue
            token_idx, pos = torch.where(top_k_index == e)
            x = hidden_states[token_idx]
            gate, up = fp8_linear(x, self.gate_up_fp8[e], self.gate_up_scale[e], None, self.backend,
                                  block=self.block).chunk(2, dim=-1)
            y = fp8_linear(self.act_fn(gate) * up, self.down_fp8[e], self.down_scale[e], None,
                           self.backend, block=self.block)
            y = y * top_k_weights[token_idx, pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


@dataclass
class SwapReport:
    """What `swap_linears` did: one `quantization_report` row per quantised weight, and the
    names it left in BF16 (kept by a pattern)."""
    quantized: list[dict] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)

    @property
    def bytes_bf16(self) -> int:
        return sum(r["bytes_bf16"] for r in self.quantized)

    @property
    def bytes_fp8(self) -> int:
        return sum(r["bytes_fp8"] for r in self.quantized)


def _set_child(model: nn.Module, dotted: str, new: nn.Module) -> None:
    parent_name, _, child = dotted.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


@torch.no_grad()
def swap_linears(model: nn.Module, keep_patterns: KeepPolicy | Sequence[str] | None = None,
                 backend: str = "auto", pow2: bool = False, block: int = DEFAULT_BLOCK,
                 experts: bool = True) -> SwapReport:
    """Replace, in place, every `nn.Linear` whose `<module>.weight` is not kept in BF16 by an
    `FP8Linear`, and (with `experts=True`) every fused expert stack by an `FP8Experts`.

    `backend` may be "auto" (resolved for the device of each module's weight) or a name.
    Tied weights: a kept `lm_head` stays tied to `embed_tokens` because neither is touched.
    """
    policy = as_policy(keep_patterns)
    report = SwapReport()
    targets = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            targets.append((name, module, "linear"))
        elif experts and is_fused_experts(module):
            targets.append((name, module, "experts"))
    for name, module, kind in targets:
        if kind == "linear":
            pname = f"{name}.weight"
            if policy.keeps(pname):
                report.kept.append(pname)
                continue
            be = select_backend(module.weight.device, backend)
            new = FP8Linear.from_linear(module, be, pow2, block)
            report.quantized.append(error_row(pname, module.weight, new.weight_fp8,
                                              new.weight_scale, block))
        else:
            pnames = [f"{name}.gate_up_proj", f"{name}.down_proj"]
            if any(policy.keeps(p) for p in pnames):
                report.kept.extend(pnames)
                continue
            be = select_backend(module.gate_up_proj.device, backend)
            new = FP8Experts.from_experts(module, be, pow2, block)
            report.quantized.append(error_row(pnames[0], module.gate_up_proj, new.gate_up_fp8,
                                              new.gate_up_scale, block))
            report.quantized.append(error_row(pnames[1], module.down_proj, new.down_fp8,
                                              new.down_scale, block))
        _set_child(model, name, new)
    return report

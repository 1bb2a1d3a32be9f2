"""Which parameters are quantised to FP8 and which stay in BF16.

FP8 is for the big GEMM weights (attention projections, dense MLPs, experts). Small or
numerically sensitive tensors stay in BF16, as in DeepSeek-V3's FP8 checkpoints:
embeddings and the LM head (tiny share of FLOPs, large effect on log-probs), router gates
(top-k decisions flip on small errors), norms and biases (1-D).

Patterns match full parameter names (`model.layers.0.mlp.gate.weight`): shell-style
(`fnmatch.fnmatchcase`, case-sensitive) by default, or a regular expression when prefixed with
`re:` (searched anywhere in the name).
"""
from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence

import torch

DEFAULT_KEEP_BF16: tuple[str, ...] = (
    "*embed_tokens*",          # Qwen3 / DeepSeek HF embedding
    "*embed.weight",           # DeepSeek original checkpoint names (`embed.weight`)
    "lm_head*",
    "*.lm_head*",
    "head.weight",             # DeepSeek original checkpoint LM head
    "*.mlp.gate.weight",       # MoE router (Qwen3-MoE, DeepSeek); NOT `gate_proj`
    "*.mlp.router.*",          # routers named `router` (e.g. gpt-oss style)
    "*shared_expert_gate*",    # Qwen2-MoE style sigmoid gate of the shared expert
    "*norm*",                  # RMSNorm / LayerNorm weights, q_a_layernorm, kv_a_layernorm
    # DeepSeek-V4 checkpoint names of the linears vLLM's V4 model builds without a quant config
    # (vllm/models/deepseek_v4: GateLinear router, indexer `weights_proj`, compressor
    # `fused_wkv_wgate`); tests/rl/rollout/test_v4_sync.py derives that set from vLLM's code.
    "*.ffn.gate.weight",
    "*.indexer.weights_proj.weight",
    "*.compressor.wkv.weight",
    "*.compressor.wgate.weight",
)
"""Name patterns kept in BF16 for Qwen3-MoE and DeepSeek-V3 style HF checkpoints."""

_FUSED_EXPERT_SUFFIXES = (".gate_up_proj", ".down_proj", ".up_proj", ".gate_proj")


def _compile(pattern: str):
    if pattern.startswith("re:"):
        rx = re.compile(pattern[3:])
        return lambda name: rx.search(name) is not None
    return lambda name: fnmatch.fnmatchcase(name, pattern)


class KeepPolicy:
    """A compiled list of keep-in-BF16 name patterns (see the module docstring for syntax)."""

    def __init__(self, patterns: Iterable[str] = DEFAULT_KEEP_BF16):
        self.patterns: tuple[str, ...] = tuple(patterns)
        for p in self.patterns:
            if not isinstance(p, str) or not p or p == "re:":
                raise ValueError(f"keep pattern: got {p!r}, expected a non-empty glob or 're:REGEX'")
            if p.startswith("re:"):
                try:
                    re.compile(p[3:])
                except re.error as exc:
                    raise ValueError(f"keep pattern {p!r}: invalid regex ({exc})") from None
        self._matchers = [_compile(p) for p in self.patterns]

    def keeps(self, name: str) -> bool:
        """True if `name` matches any keep pattern."""
        return any(m(name) for m in self._matchers)

    def matching_pattern(self, name: str) -> str | None:
        """The first pattern that keeps `name` (for reports), or None."""
        for p, m in zip(self.patterns, self._matchers):
            if m(name):
                return p
        return None


def as_policy(keep: KeepPolicy | Sequence[str] | None) -> KeepPolicy:
    """Accept a policy, a pattern list, or None (= `DEFAULT_KEEP_BF16`)."""
    if keep is None:
        return KeepPolicy()
    if isinstance(keep, KeepPolicy):
        return keep
    if isinstance(keep, str):
        raise ValueError(f"keep patterns: got the string {keep!r}, expected a list of patterns")
    return KeepPolicy(keep)


def keep_in_bf16(name: str, keep: KeepPolicy | Sequence[str] | None = None) -> bool:
    """True if the parameter `name` matches a keep-in-BF16 pattern."""
    return as_policy(keep).keeps(name)


def should_quantize(name: str, tensor: torch.Tensor | torch.Size | tuple[int, ...],
                    keep: KeepPolicy | Sequence[str] | None = None) -> bool:
    """Decide whether the parameter `name` with `tensor` (or its shape) goes to FP8.

    Quantised: 2-D `*.weight` matrices of linear layers, and 3-D fused expert stacks
    `(E, N, K)` named `*.gate_up_proj` / `*.down_proj` (transformers 5.x MoE layout); in both
    cases only when no keep pattern matches. Everything else (1-D norms and biases, buffers,
    embeddings, routers) stays in BF16. Floating-point dtypes only.
    """
    if isinstance(tensor, torch.Tensor):
        if not tensor.is_floating_point():
            return False
        shape = tuple(tensor.shape)
    else:
        shape = tuple(tensor)
    if any(s == 0 for s in shape):
        return False
    if len(shape) == 2:
        eligible = name.endswith(".weight") or name == "weight"
    elif len(shape) == 3:
        eligible = name.endswith(_FUSED_EXPERT_SUFFIXES)
    else:
        eligible = False
    return eligible and not as_policy(keep).keeps(name)

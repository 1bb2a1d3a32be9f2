"""Which attention the trainer's models run: one rule, read by `loading.load_model` and the planner.

Kept free of torch / transformers imports so the planner stays a config-only tool.
"""
from __future__ import annotations

ATTENTION_KERNELS = ("auto", "eager", "fused")
# Architectures whose transformers code is eager-only; `rl.models.v4_attention` is our fused one.
EAGER_ONLY = frozenset({"deepseek_v4"})


def attention_kernel(model_type: str, requested: str = "auto") -> str:
    """The attention run for `model_type`: "eager" ((heads x S x S) scores) or "fused" (O(S)
    memory: SDPA, or `rl.models.v4_attention` for DeepSeek-V4).

    `requested` "auto" and "fused" give "fused" for every architecture; "eager" is honoured only
    where transformers' eager is the reference implementation (DeepSeek-V4); others keep SDPA.
    """
    if requested not in ATTENTION_KERNELS:
        raise ValueError(f"attention kernel {requested!r}; expected one of {ATTENTION_KERNELS}")
    return "eager" if requested == "eager" and model_type in EAGER_ONLY else "fused"

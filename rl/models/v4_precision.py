"""DeepSeek-V4 in BF16: fp32 inside the norms, the input's dtype out of them.

transformers 5.19 keeps V4's norms, hyper-connection mixers, sinks and compressor position
biases in fp32 (`_keep_in_fp32_modules_strict`), as DeepSeek's checkpoint stores them. Its
`DeepseekV4RMSNorm` then returns `weight_fp32 * x.to(input_dtype)`: an fp32 tensor, which reaches
the BF16 linears after it (`q_a_proj`: "expected m1 and m2 to have the same dtype, but got:
float != c10::BFloat16"), so a BF16 V4 cannot run a single forward. DeepSeek's reference
inference computes the norm in fp32 and casts the result back at the boundary:
`(weight * x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(x.dtype)`. `install(model)` gives every
`DeepseekV4RMSNorm` that forward. The other fp32 modules already hand their consumers the right
dtype: the hyper-connections' Sinkhorn runs in fp32 and the decoder layer casts its mixes back;
the indexer's fp32 scores only feed a top-k.

In fp32 the result is the same function (one rounding fewer in BF16: the product is formed in
fp32, then rounded once).
"""
from __future__ import annotations

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm


class BoundaryRMSNorm(DeepseekV4RMSNorm):
    """`DeepseekV4RMSNorm` computed in fp32 and returned in the input's dtype."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * x).to(hidden_states.dtype)


def install(model) -> int:
    """Give every `DeepseekV4RMSNorm` of `model` the boundary cast; returns how many.

    The class swap keeps the parameter, its name and DeepSpeed's bookkeeping (like
    `rl.models.v4_attention.install`)."""
    count = 0
    for module in model.modules():
        if type(module) is DeepseekV4RMSNorm:
            module.__class__ = BoundaryRMSNorm
            count += 1
    return count

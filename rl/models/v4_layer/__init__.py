"""DeepSeek-V4's decoder layer outside attention, fast on GPUs: hyper-connections, norms, MoE.

`install(model)` (called by `rl.models.loading.load_model` for a V4 loaded on a CUDA device, or
wherever `RL_V4_LAYER=1`; `RL_V4_LAYER=0` keeps transformers' layer: `requested()`) swaps
transformers' decoder layer, hyper-connection mixers, final head, RMSNorms, MoE block and shared expert for the
subclasses in `modules` (same parameters) and makes `moe.experts_forward` the experts
implementation. What each replaces and why: `hyper` (mixers and norms: fused functions,
compiled on CUDA, see `compiled` for the `RL_V4_COMPILE` switch), `moe` (the routed experts
without scatter-adds). Outputs and gradients are transformers' to fp32 rounding in fp32; in
bf16 the stream mix rounds once where transformers rounds at each step (`hyper`). The attention
is `rl.models.v4_attention`'s.
"""
from __future__ import annotations

import os

import torch

from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4DecoderLayer, DeepseekV4HyperConnection, DeepseekV4HyperHead, DeepseekV4MLP,
    DeepseekV4RMSNorm, DeepseekV4SparseMoeBlock)

from rl.models.v4_layer import modules
from rl.models.v4_layer.moe import IMPLEMENTATION, experts_forward
from rl.models.v4_precision import BoundaryRMSNorm

SWAPS = {DeepseekV4DecoderLayer: modules.FusedDecoderLayer,
         DeepseekV4HyperConnection: modules.FusedHyperConnection,
         DeepseekV4HyperHead: modules.FusedHyperHead,
         DeepseekV4MLP: modules.FusedMLP,
         DeepseekV4SparseMoeBlock: modules.FusedMoeBlock,
         DeepseekV4RMSNorm: modules.FusedRMSNorm,
         BoundaryRMSNorm: modules.FusedRMSNorm}
"""transformers' (or v4_precision's) class -> its fused subclass."""


ENV = "RL_V4_LAYER"


def requested(device="cpu") -> bool:
    """Whether `load_model` installs the fused layer for a model going to `device`
    (`RL_V4_LAYER`: 1 yes, 0 no, unset: on CUDA devices only, where it is compiled and pays)."""
    value = os.environ.get(ENV)
    if value is None:
        return torch.device(device).type == "cuda"
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}={value!r}; expected 0 or 1 (unset: 1 on CUDA devices)")
    return value == "1"


def install(model) -> int:
    """Switch `model` (a transformers DeepSeek-V4) to the fused layer; returns how many modules
    changed class. The experts implementation becomes `moe.IMPLEMENTATION` (registered here)."""
    act = getattr(model.config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"rl.models.v4_layer: hidden_act {act!r}; the fused SwiGLU is silu's "
                         "(every DeepSeek-V4 checkpoint)")
    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, experts_forward)
    model.set_experts_implementation(IMPLEMENTATION)
    count = 0
    for module in model.modules():
        fused = SWAPS.get(type(module))
        if fused is not None:
            module.__class__ = fused
            count += 1
    return count


def restore(model, experts: str = "grouped_mm") -> int:
    """The inverse of `install` (benchmarks and tests compare both on one model): transformers'
    classes back, RMSNorms as `v4_precision.BoundaryRMSNorm` (what `load_model` gave before),
    `experts` as the experts implementation. Returns how many modules changed class."""
    back = {fused: hf for hf, fused in SWAPS.items() if hf is not DeepseekV4RMSNorm}
    count = 0
    for module in model.modules():
        hf = back.get(type(module))
        if hf is not None:
            module.__class__ = hf
            count += 1
    model.set_experts_implementation(experts)
    return count

"""Grouped-GEMM experts under DeepSpeed on GPUs: 16-byte alignment of the expert weights.

transformers runs MoE experts through `torch.nn.functional.grouped_mm` (its `grouped_mm`
experts implementation, the fast one), whose CUDA kernel needs every operand's data pointer
16-byte aligned ("expected data_ptr to be aligned to 16 bytes"). DeepSpeed lays parameters into
flat buffers and hands the model views into them: ZeRO-1/2's flat bf16 partition, ZeRO-3's
coalesced all-gather buffer, with no padding between parameters beyond ZeRO-3's rounding to the
world size. One parameter of an odd element count before the experts (DeepSeek-V4's
hyper-connection `scale` has 3) shifts every later view off alignment; at 16 ranks ZeRO-3's
rounding keeps them aligned, at 1 or 2 it does not. transformers checks alignment only on CPUs,
where torch >= 2.11 takes misaligned operands anyway.

`install(model)` makes the trainer's grouped_mm experts check their operands on every call and,
when one is misaligned, run grouped_mm on aligned copies of the misaligned ones (`clone`: a fresh
allocation; autograd takes the gradient back to the views). The copies cost one layer's expert
weights for the layers in flight. transformers' own alternative, `batched_mm`, gathers each
token's expert weights: at DeepSeek-V4-Flash's dimensions 32 MiB per token and expert choice
(48 GiB for two 256-token samples, an out-of-memory on a 141 GB H200). The first fallback is
logged.
"""
from __future__ import annotations

import logging

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward

log = logging.getLogger(__name__)

IMPLEMENTATION = "grouped_mm_aligned"
"""The experts implementation `install` registers with transformers."""
_warned = False


def misaligned(module: torch.nn.Module, hidden_states: torch.Tensor, alignment: int = 16
               ) -> list[str]:
    """Names of `module`'s own parameters (and "hidden_states") whose data pointer is not
    `alignment`-byte aligned."""
    bad = [n for n, p in module.named_parameters(recurse=False) if p.data_ptr() % alignment]
    return bad + (["hidden_states"] if hidden_states.data_ptr() % alignment else [])


class _AlignedCopies:
    """`module` as the experts function reads it, with aligned copies of the parameters
    `names` (the rest, methods included, are the module's own)."""

    def __init__(self, module: torch.nn.Module, names: list[str]):
        self._module = module
        self._copies = {n: getattr(module, n).clone() for n in names}

    def __getattr__(self, name: str):
        copies = self.__dict__["_copies"]
        return copies[name] if name in copies else getattr(self.__dict__["_module"], name)


def aligned_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """grouped_mm, on aligned copies of whichever operands are misaligned."""
    global _warned
    bad = misaligned(self, hidden_states)
    if not bad:
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    if not _warned:
        _warned = True
        log.warning("expert operands %s are not 16-byte aligned (views into DeepSpeed's flat "
                    "buffer): grouped_mm runs on aligned copies of them", bad)
    if "hidden_states" in bad:
        hidden_states = hidden_states.clone()
    params = [n for n in bad if n != "hidden_states"]
    module = _AlignedCopies(self, params) if params else self
    return grouped_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)


def install(model) -> bool:
    """Switch `model`'s grouped_mm experts to `IMPLEMENTATION`; False if it runs others."""
    if getattr(model.config, "_experts_implementation", None) != "grouped_mm":
        return False
    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, aligned_experts_forward)
    model.set_experts_implementation(IMPLEMENTATION)
    return True

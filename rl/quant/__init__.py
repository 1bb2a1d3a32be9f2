"""Block FP8 (DeepSeek layout) for the rollout side: quantisers, keep-in-BF16 policy, error
reports, run-time kernel backends (aiter / cuda / torch), FP8 modules and wire helpers."""
from rl.quant.backends import (
    BACKENDS, BackendUnavailableError, fp8_linear, select_backend, vllm_aiter_env,
)
from rl.quant.block_fp8 import (
    FP8_DTYPE, FP8_MAX, dequantize_act_group, dequantize_weight_block, quantize_act_group,
    quantize_weight_block,
)
from rl.quant.modules import FP8Experts, FP8Linear, SwapReport, swap_linears
from rl.quant.policy import DEFAULT_KEEP_BF16, KeepPolicy, keep_in_bf16, should_quantize
from rl.quant.report import format_report, quantization_report
from rl.quant.wire import pack_fp8_for_wire, scale_name, unpack_fp8_from_wire, wire_to_fp8

__all__ = [
    "BACKENDS", "BackendUnavailableError", "DEFAULT_KEEP_BF16", "FP8Experts", "FP8Linear",
    "FP8_DTYPE", "FP8_MAX", "KeepPolicy", "SwapReport", "dequantize_act_group",
    "dequantize_weight_block", "format_report", "fp8_linear", "keep_in_bf16", "pack_fp8_for_wire",
    "quantization_report", "quantize_act_group", "quantize_weight_block", "scale_name",
    "select_backend", "should_quantize", "swap_linears", "unpack_fp8_from_wire", "vllm_aiter_env",
    "wire_to_fp8",
]

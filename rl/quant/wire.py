"""FP8 on the wire for the trainer -> rollout weight sync.

The sender quantises a BF16/FP32 weight to block FP8 and sends the e4m3 bytes as `uint8`
(collectives such as gloo have no float8 dtype; a `view` is free) plus the fp32 block scales:
about half the bytes of BF16 (1 byte per element + 4 bytes per 128x128 block).

Naming follows DeepSeek-V3 / vLLM block-FP8 checkpoints: the scale of `x.weight` travels as
`x.weight_scale_inv` (it multiplies the FP8 values, despite the name).
"""
from __future__ import annotations

import torch

from rl.quant.block_fp8 import (
    DEFAULT_BLOCK, FP8_DTYPE, dequantize_weight_block, quantize_weight_block,
)


def pack_fp8_for_wire(w: torch.Tensor, block: int = DEFAULT_BLOCK,
                      pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) or (E, N, K) float weight -> (uint8 tensor of the same shape, fp32 block scales)."""
    w8, scale = quantize_weight_block(w, block, pow2)
    return w8.view(torch.uint8), scale


def wire_to_fp8(w_u8: torch.Tensor) -> torch.Tensor:
    """Reinterpret received uint8 bytes as float8_e4m3fn (no copy)."""
    if w_u8.dtype != torch.uint8:
        raise ValueError(f"wire_to_fp8: expected uint8 bytes, got {w_u8.dtype}")
    return w_u8.view(FP8_DTYPE)


def unpack_fp8_from_wire(w_u8: torch.Tensor, scale: torch.Tensor, block: int = DEFAULT_BLOCK,
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Received (uint8 bytes, scales) -> dequantised weight in `dtype`, same shape as sent."""
    return dequantize_weight_block(wire_to_fp8(w_u8), scale, block, dtype)


def scale_name(weight_name: str) -> str:
    """`model.layers.0.self_attn.q_proj.weight` -> `...q_proj.weight_scale_inv`."""
    return f"{weight_name}_scale_inv"

"""DeepSeek-style block FP8: e4m3 values with one fp32 scale per block.

Weights `w_NK` (out_features N, in_features K) get one scale per 128x128 block; activations
`x_MK` get one scale per 1x128 group along K. Fused MoE expert stacks `w_ENK` are quantised
per expert with the same 128x128 blocks (scales `(E, ceil(N/128), ceil(K/128))`).

Conventions (the same as DeepSeek-V3 checkpoints and vLLM's `weight_scale_inv`):
- the scale is a *dequantisation multiplier*: `w ~= w8.float() * scale` (block-broadcast);
- `scale = amax(|block|) / 448` (448 = largest finite e4m3fn), so every block uses the full
  e4m3 range; an all-zero block gets scale 1.0 (never 0: that would make the inverse inf/NaN);
- `pow2=True` rounds every scale up to 2**ceil(log2(scale)); scaling by a power of two is exact,
  and rounding *up* keeps |w / scale| <= 448 so nothing saturates;
- shapes that are not multiples of the block are zero-padded internally; the returned FP8 tensor
  has the input's shape and the scales cover the padded blocks (`ceil(N/128), ceil(K/128)`).

All arithmetic runs in fp32 on the input's device; no GPU is needed.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
DEFAULT_BLOCK = 128


def num_blocks(size: int, block: int) -> int:
    """Blocks needed to cover `size` elements (the last one may be partial)."""
    return -(-size // block)


def _check_block(block: int) -> None:
    if not isinstance(block, int) or block <= 0:
        raise ValueError(f"block: got {block!r}, expected a positive int (DeepSeek uses 128)")


def _scale_from_amax(amax: torch.Tensor, pow2: bool, exact: bool = False) -> torch.Tensor:
    """fp32 dequantisation scales from per-block amax (zero blocks -> 1.0).

    `exact`: the correctly rounded fp32 quotient, computed in fp64. A backend may divide a tensor
    by a scalar as a multiply by its reciprocal (1 ulp off for some blocks), and one ulp in a
    scale changes every dequantised value of its block: weight scales must be the same bits on
    every device (the sync's tests compare the engine's weights with a CPU reference).
    """
    scale = (amax.double() / FP8_MAX).float() if exact else amax.float() / FP8_MAX
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return scale


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    # The clamp only matters for rounding at the very top of the range: casting a value
    # above 448 to e4m3fn gives NaN (the format has no inf), never a saturated 448.
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_weight_block(
    w: torch.Tensor, block: int = DEFAULT_BLOCK, pow2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise `w` of shape (N, K) or (E, N, K) to e4m3 with one scale per block x block tile.

    Returns `(w8, scale)`: `w8` has `w`'s shape and dtype float8_e4m3fn; `scale` is fp32 of
    shape (..., ceil(N/block), ceil(K/block)).
    """
    _check_block(block)
    if w.dim() not in (2, 3):
        raise ValueError(f"quantize_weight_block: got a {w.dim()}-D tensor {tuple(w.shape)}, "
                         "expected (N, K) or (E, N, K)")
    if not w.is_floating_point():
        raise ValueError(f"quantize_weight_block: got dtype {w.dtype}, expected a float tensor")
    *lead, n, k = w.shape
    nb, kb = num_blocks(n, block), num_blocks(k, block)
    w32 = w.float()
    if nb * block != n or kb * block != k:
        w32 = F.pad(w32, (0, kb * block - k, 0, nb * block - n))
    tiles = w32.reshape(*lead, nb, block, kb, block)
    amax = tiles.abs().amax(dim=(-3, -1))                   # (..., nb, kb)
    scale = _scale_from_amax(amax, pow2, exact=True)
    q = _to_fp8(tiles / scale[..., :, None, :, None])
    w8 = q.reshape(*lead, nb * block, kb * block)[..., :n, :k].contiguous()
    return w8, scale


def expand_block_scale(scale: torch.Tensor, shape: torch.Size | tuple[int, ...],
                       block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """Broadcast block scales (..., nb, kb) to a full (..., N, K) fp32 tensor."""
    n, k = shape[-2], shape[-1]
    full = scale.float().repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return full[..., :n, :k]


def dequantize_weight_block(
    w8: torch.Tensor, scale: torch.Tensor, block: int = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Inverse of `quantize_weight_block`: `w8 * scale` (block-broadcast), cast to `dtype`."""
    _check_block(block)
    *lead, n, k = w8.shape
    expected = (*lead, num_blocks(n, block), num_blocks(k, block))
    if tuple(scale.shape) != expected:
        raise ValueError(f"dequantize_weight_block: scale shape {tuple(scale.shape)} does not "
                         f"match weight {tuple(w8.shape)} with block {block}: expected {expected}")
    return (w8.float() * expand_block_scale(scale, w8.shape, block)).to(dtype)


def quantize_act_group(
    x: torch.Tensor, group: int = DEFAULT_BLOCK, pow2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise activations (..., K) with one scale per contiguous group of `group` along K.

    Returns `(x8, scale)`: `x8` float8_e4m3fn with `x`'s shape; `scale` fp32 (..., ceil(K/group)).
    """
    _check_block(group)
    *lead, k = x.shape
    g = num_blocks(k, group)
    x32 = x.float()
    if g * group != k:
        x32 = F.pad(x32, (0, g * group - k))
    groups = x32.reshape(*lead, g, group)
    scale = _scale_from_amax(groups.abs().amax(dim=-1), pow2)
    x8 = _to_fp8(groups / scale[..., None]).reshape(*lead, g * group)[..., :k].contiguous()
    return x8, scale


def dequantize_act_group(x8: torch.Tensor, scale: torch.Tensor, group: int = DEFAULT_BLOCK,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_act_group`."""
    k = x8.shape[-1]
    full = scale.float().repeat_interleave(group, dim=-1)[..., :k]
    return (x8.float() * full).to(dtype)


def fp8_e4m3fn_to_fnuz(w8: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reinterpret e4m3fn data as e4m3fnuz (the FP8 format of MI300 / gfx942) without requantising.

    The same bit pattern is worth half as much in fnuz (exponent bias 8 vs 7), so scales double;
    0x80 (-0.0 in fn) is NaN in fnuz and becomes +0. Same recipe as vLLM's
    `normalize_e4m3fn_to_e4m3fnuz`.
    """
    bits = w8.view(torch.int8).clone()
    bits[bits == -128] = 0
    return bits.view(torch.float8_e4m3fnuz), scale * 2.0


def fp8_bytes(shape: tuple[int, ...], block: int = DEFAULT_BLOCK) -> int:
    """Bytes of the FP8 values plus their fp32 block scales for a weight of `shape`."""
    *lead, n, k = shape
    return math.prod(shape) + 4 * math.prod(lead) * num_blocks(n, block) * num_blocks(k, block)

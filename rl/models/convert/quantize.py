"""DeepSeek's ue8m0 quantisers: BF16/fp32 weights into the published FP8 / FP4 forms (the
inverse of `source.dequantize`).

Both follow DeepSeek-V4's reference kernels (`inference/kernel.py`: `act_quant` with
`scale_fmt="ue8m0"` and `fp4_act_quant`), applied to weight blocks:
  * the scale is `fast_round_scale`: `2 ** ceil(log2(max(amax, floor) * fl32(1 / qmax)))`,
    computed on the fp32 bits (a power of two, so it is stored exactly as ue8m0);
    qmax = 448 (e4m3) with floor 1e-4, qmax = 6 (e2m1) with floor 6 * 2**-126. Rounding the
    scale up keeps every |w / scale| <= qmax; an all-zero block gets the floor's scale
    (2**-22 for FP8, 2**-126 for FP4) and zero values;
  * the values are `clamp(w / scale, -qmax, qmax)` rounded to nearest, ties to even (the
    hardware cast): e4m3 through torch's cast, e2m1 by the thresholds below;
  * FP8 blocks are 128 x 128 tiles of an (N, K) weight (partial tiles at the edges: the scale
    covers what is there); FP4 groups are 32 consecutive inputs of one row, two e2m1 codes per
    byte, element 2j in the low nibble (`source.unpack_fp4`'s order and table).
Dividing by a power of two is exact, so dequantising (`q * scale`) a quantised weight and
quantising it again gives the same values: an unchanged published tensor survives the round
trip through the trainer's BF16 exactly. Non-finite inputs are refused (a `ValueError` naming
the first one's index): NaN has no e2m1 code and would silently become the block's maximum.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rl.models.convert.source import FP4_BLOCK, FP4_VALUES
from rl.quant.block_fp8 import FP8_DTYPE, FP8_MAX, num_blocks

FP4_MAX = 6.0
FP8_AMAX_FLOOR = 1e-4
FP4_AMAX_FLOOR = 6 * 2.0 ** -126
# |v| thresholds between consecutive e2m1 magnitudes, each with the tie's direction: a tie
# goes to the even code (0, 1.0, 2.0, 4.0: codes 0, 2, 4, 6), so `>=` where the upper code is
# even and `>` where the lower one is.
_E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
               (3.5, True), (5.0, False))
assert len(_E2M1_STEPS) + 1 == len(FP4_VALUES) // 2


def ue8m0_scale(amax: torch.Tensor, qmax: float, floor: float) -> torch.Tensor:
    """DeepSeek's `fast_round_scale` of per-block amax: fp32 powers of two, same shape."""
    x = amax.float().clamp_min(floor) * torch.tensor(1.0 / qmax, dtype=torch.float32)
    bits = x.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).int()
    return ((exponent + 127) << 23).view(torch.float32)


def check_finite(w: torch.Tensor) -> None:
    """Refuse inf / NaN (a `ValueError` naming the first one)."""
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        where = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(f"{w[tuple(where)].item()} at index {where}: inf / NaN cannot be "
                         "quantised (the trained weights diverged?)")


def _check_2d(w: torch.Tensor, what: str) -> None:
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"{what}: got a {w.dim()}-D {w.dtype} tensor of shape "
                         f"{tuple(w.shape)}, expected a 2-D float weight (N, K)")


def quantize_fp8(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (e4m3 (N, K), fp32 power-of-two scales (ceil(N/block), ceil(K/block)))."""
    _check_2d(w, "quantize_fp8")
    check_finite(w)
    n, k = w.shape
    nb, kb = num_blocks(n, block), num_blocks(k, block)
    # Zero padding leaves every tile's amax as it is; the padded values are cut off again.
    tiles = F.pad(w.float(), (0, kb * block - k, 0, nb * block - n)).view(nb, block, kb, block)
    scale = ue8m0_scale(tiles.abs().amax(dim=(1, 3)), FP8_MAX, FP8_AMAX_FLOOR)
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nb * block, kb * block)[:n, :k].contiguous(), scale


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """fp32 values with |v| <= 6 -> their nearest e2m1 codes (uint8 0-15, bit 3 the sign;
    ties to even). A negative value that rounds to 0 keeps its sign (-0, code 8)."""
    a = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8)
    for threshold, tie_up in _E2M1_STEPS:
        code += (a >= threshold if tie_up else a > threshold).to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """(..., K) e2m1 codes -> (..., K/2) int8, element 2j in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8)


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float, K a multiple of 32 -> (packed e2m1 int8 (N, K/2), fp32 power-of-two
    scales (N, K/32))."""
    _check_2d(w, "quantize_fp4")
    n, k = w.shape
    if k % FP4_BLOCK:
        raise ValueError(f"quantize_fp4: {k} inputs, expected a multiple of {FP4_BLOCK} "
                         "(one scale per 32 inputs)")
    check_finite(w)
    groups = w.float().reshape(n, k // FP4_BLOCK, FP4_BLOCK)
    scale = ue8m0_scale(groups.abs().amax(dim=-1), FP4_MAX, FP4_AMAX_FLOOR)
    v = (groups / scale[..., None]).clamp(-FP4_MAX, FP4_MAX)
    return pack_fp4(e2m1_codes(v).view(n, k)), scale


def quantize(kind: str, w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8` ('fp8') or `quantize_fp4` ('fp4'); fp32 scales (cast them to store)."""
    if kind == "fp4":
        return quantize_fp4(w)
    if kind == "fp8":
        return quantize_fp8(w, block)
    raise ValueError(f"quantize: kind {kind!r}, expected 'fp8' or 'fp4'")

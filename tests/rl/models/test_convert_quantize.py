"""The ue8m0 quantisers of the `deepseek-v4` export (`rl.models.convert.quantize`) against a
direct reference computation written here: scales by `math.frexp` on the fp32 product
DeepSeek's kernel forms, values by searching the whole e4m3 / e2m1 value set for the nearest one
(ties to the even code), one block at a time in plain Python loops."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rl.models.convert.quantize import (
    FP4_AMAX_FLOOR, FP8_AMAX_FLOOR, e2m1_codes, quantize, quantize_fp4, quantize_fp8,
)
from rl.models.convert.source import dequantize, unpack_fp4

# the 127 finite non-negative e4m3 values, byte 0x00 to 0x7E: increasing with the byte
E4M3_POS = torch.arange(127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def ref_scale(amax: float, qmax: float, floor: float) -> float:
    """2 ** ceil(log2(r)) for DeepSeek's fp32 r = max(amax, floor) * fl32(1 / qmax)."""
    r = float(np.float32(max(amax, floor)) * np.float32(1.0 / qmax))
    mantissa, exponent = math.frexp(r)  # r = mantissa * 2**exponent, mantissa in [0.5, 1)
    return 2.0 ** (exponent - 1 if mantissa == 0.5 else exponent)


def ref_e4m3(v: torch.Tensor) -> torch.Tensor:
    """The nearest finite e4m3 value of each v (fp64, |v| <= 448): of the two values around |v|
    the closer one, a tie to the even byte; v's sign."""
    a = v.abs()
    hi = torch.searchsorted(E4M3_POS, a).clamp(max=126)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - E4M3_POS[lo], E4M3_POS[hi] - a
    pick = torch.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    return torch.copysign(E4M3_POS[pick], v)


def ref_e2m1(v: float) -> float:
    best = min(range(8), key=lambda i: (abs(E2M1[i] - abs(v)), i % 2))
    return math.copysign(E2M1[best], v)


def ref_fp8(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantised fp32 values, fp32 scales), block by block (partial edge blocks as they are)."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    out, scales = torch.empty(n, k), torch.empty(nb, kb)
    for i in range(nb):
        for j in range(kb):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block].double()
            s = ref_scale(tile.abs().max().item(), 448.0, FP8_AMAX_FLOOR)
            scales[i, j] = s
            q = ref_e4m3((tile / s).flatten()).view(tile.shape) * s
            out[i * block:(i + 1) * block, j * block:(j + 1) * block] = q.float()
    return out, scales


def ref_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    out, scales = torch.empty(n, k), torch.empty(n, k // 32)
    for r in range(n):
        for g in range(k // 32):
            seg = w[r, g * 32:(g + 1) * 32].double().tolist()
            s = ref_scale(max(abs(x) for x in seg), 6.0, FP4_AMAX_FLOOR)
            scales[r, g] = s
            out[r, g * 32:(g + 1) * 32] = torch.tensor([ref_e2m1(x / s) * s for x in seg])
    return out, scales


def weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """BF16 weights (values with few mantissa bits: many exact ties) whose rows span 10
    binades, with an all-zero stretch."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 0, n)[:, None]
    w[: min(n, 40), : min(k, 64)] = 0.0
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("shape", [(130, 300), (128, 256), (40, 64)])
def test_fp8_equals_the_reference_for_any_shape(shape):
    w = weights(*shape)
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == shape
    assert scale.dtype == torch.float32 and scale.shape == (-(-shape[0] // 128),
                                                            -(-shape[1] // 128))
    values, scales = ref_fp8(w.float())
    assert torch.equal(scale, scales)
    deq = dequantize("fp8", q, scale, 128, torch.float32)
    assert torch.equal(deq, values)
    # ue8m0: every scale is stored exactly as one exponent byte
    assert torch.equal(scale.to(torch.float8_e8m0fnu).float(), scale)
    # scales rounded up: nothing clipped, every value within half an e4m3 step of its weight
    # (at most 16 * scale, the step between 256 and 448)
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:shape[0], :shape[1]]
    assert torch.all((w.float() - deq).abs() <= 16 * full)
    assert torch.all((w.float() - deq).abs() <= torch.maximum(w.float().abs() / 16,
                                                              full * 2.0 ** -10))


@pytest.mark.parametrize("shape", [(6, 96), (3, 32)])
def test_fp4_equals_the_reference(shape):
    w = weights(*shape, seed=1)
    w[0, -32:] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4) * \
        torch.tensor([1.0, -1.0] * 16)  # every tie, both signs; amax 6 -> scale 1
    packed, scale = quantize_fp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (shape[0], shape[1] // 2)
    assert scale.shape == (shape[0], shape[1] // 32)
    values, scales = ref_fp4(w.float())
    assert torch.equal(scale, scales)
    deq = dequantize("fp4", packed, scale, 128, torch.float32)
    assert torch.equal(deq, values)
    assert deq[0, -32:-24].tolist() == [0.0, -1.0, 1.0, -2.0, 2.0, -4.0, 4.0, -6.0]
    full = scale.repeat_interleave(32, 1)
    assert torch.all((w.float() - deq).abs() <= full)  # half the widest e2m1 step (4 -> 6)
    # element 2j in the low nibble, as the converter unpacks it
    assert torch.equal(unpack_fp4(packed)[0, -32:-30], torch.tensor([0.0, -1.0]))


def test_all_zero_blocks_get_the_floor_scale_and_zero_values():
    q, scale = quantize_fp8(torch.zeros(130, 129))
    assert torch.all(scale == 2.0 ** -22) and not q.float().any()
    packed, scale4 = quantize_fp4(torch.zeros(2, 64))
    assert torch.all(scale4 == 2.0 ** -126) and not packed.any()
    assert ref_scale(0.0, 448.0, FP8_AMAX_FLOOR) == 2.0 ** -22
    assert ref_scale(0.0, 6.0, FP4_AMAX_FLOOR) == 2.0 ** -126


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_non_finite_values_are_refused(kind, bad):
    w = torch.ones(4, 64)
    w[2, 33] = bad
    with pytest.raises(ValueError, match=r"at index \[2, 33\]: inf / NaN cannot be quantised"):
        quantize(kind, w)


def test_shape_errors():
    with pytest.raises(ValueError, match=r"48 inputs, expected a multiple of 32"):
        quantize_fp4(torch.ones(2, 48))
    with pytest.raises(ValueError, match=r"expected a 2-D float weight"):
        quantize_fp8(torch.ones(2, 3, 4))


@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_requantising_a_dequantised_weight_is_lossless(kind):
    """An unchanged published tensor keeps its values through BF16 and back (scales may
    halve: the largest value need not reach the top of the range)."""
    q, scale = quantize(kind, weights(64, 256, seed=2))
    deq = dequantize(kind, q, scale, 128, torch.bfloat16)
    assert torch.equal(dequantize(kind, q, scale, 128, torch.float32), deq.float())  # exact
    q2, scale2 = quantize(kind, deq)
    assert torch.equal(dequantize(kind, q2, scale2, 128, torch.float32), deq.float())


def test_e2m1_codes_round_to_nearest_even():
    v = torch.tensor([0.2, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, -0.1, -6.0])
    assert e2m1_codes(v).tolist() == [0, 0, 1, 2, 2, 4, 4, 6, 6, 7, 8, 15]

"""Block FP8 quantisers: error bounds, scale rules, padding, zeros, expert stacks."""
import math

import pytest
import torch

from rl.quant.block_fp8 import (
    FP8_DTYPE, FP8_MAX, dequantize_act_group, dequantize_weight_block, expand_block_scale,
    fp8_bytes, fp8_e4m3fn_to_fnuz, quantize_act_group, quantize_weight_block,
)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def gaussian(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("pow2", [False, True])
def test_roundtrip_gaussian_rel_err_below_4_percent(pow2):
    w = gaussian(256, 384)
    w8, scale = quantize_weight_block(w, pow2=pow2)
    assert w8.dtype == FP8_DTYPE and w8.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (2, 3)
    err = rel_err(dequantize_weight_block(w8, scale, dtype=torch.float32), w)
    assert 1e-3 < err < 0.04   # e4m3 has 3 mantissa bits: ~2.7% is expected, 0 would be a bug


def test_scale_is_block_amax_over_448_and_blocks_use_full_range():
    w = gaussian(256, 256)
    w[3, 200] = 50.0   # outlier in block (0, 1) only
    w8, scale = quantize_weight_block(w)
    amax = w.reshape(2, 128, 2, 128).abs().amax(dim=(1, 3))
    torch.testing.assert_close(scale, amax / FP8_MAX)
    assert scale[0, 1] > 10 * scale[0, 0]  # the outlier does not leak into other blocks
    per_block_max = w8.float().reshape(2, 128, 2, 128).abs().amax(dim=(1, 3))
    assert torch.all(per_block_max == FP8_MAX)


def test_pow2_scales_are_powers_of_two_and_never_saturate():
    w = gaussian(300, 200) * 3.7
    w8, scale = quantize_weight_block(w, pow2=True)
    log2 = torch.log2(scale)
    assert torch.equal(log2, torch.round(log2))
    padded = torch.nn.functional.pad(w, (0, 56, 0, 84)).reshape(3, 128, 2, 128)
    assert torch.all(scale >= padded.abs().amax(dim=(1, 3)) / FP8_MAX)
    assert not torch.isnan(w8.float()).any()
    assert rel_err(dequantize_weight_block(w8, scale, dtype=torch.float32), w) < 0.04


@pytest.mark.parametrize("shape", [(130, 200), (1, 1), (127, 129), (5, 1000)])
def test_shapes_not_divisible_by_block(shape):
    w = gaussian(*shape, seed=1)
    w8, scale = quantize_weight_block(w)
    assert w8.shape == shape
    assert scale.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    assert rel_err(dequantize_weight_block(w8, scale, dtype=torch.float32), w) < 0.04


def test_zero_tensor_and_zero_blocks():
    w8, scale = quantize_weight_block(torch.zeros(200, 130))
    assert torch.equal(scale, torch.ones(2, 2)) and torch.all(w8.float() == 0)
    assert torch.all(dequantize_weight_block(w8, scale) == 0)
    w = gaussian(256, 256)
    w[:128, :128] = 0
    w8, scale = quantize_weight_block(w)
    deq = dequantize_weight_block(w8, scale, dtype=torch.float32)
    assert scale[0, 0] == 1.0 and torch.all(deq[:128, :128] == 0)
    assert torch.isfinite(deq).all() and rel_err(deq, w) < 0.04


def test_large_values_and_bf16_input():
    w = (gaussian(128, 256) * 1e4).bfloat16()
    w8, scale = quantize_weight_block(w)
    deq = dequantize_weight_block(w8, scale)
    assert deq.dtype == torch.bfloat16 and torch.isfinite(deq.float()).all()
    assert rel_err(deq, w) < 0.04


def test_expert_stack_equals_per_expert_quantisation():
    w = gaussian(3, 130, 200)
    w8, scale = quantize_weight_block(w)
    assert w8.shape == (3, 130, 200) and scale.shape == (3, 2, 2)
    for e in range(3):
        w8_e, scale_e = quantize_weight_block(w[e])
        assert torch.equal(w8[e].view(torch.uint8), w8_e.view(torch.uint8))
        assert torch.equal(scale[e], scale_e)
    assert rel_err(dequantize_weight_block(w8, scale, dtype=torch.float32), w) < 0.04


def test_activation_groups_along_k():
    x = gaussian(5, 300, seed=2)
    x8, scale = quantize_act_group(x)
    assert x8.shape == (5, 300) and scale.shape == (5, 3)
    groups = torch.nn.functional.pad(x, (0, 84)).reshape(5, 3, 128)
    torch.testing.assert_close(scale, groups.abs().amax(-1) / FP8_MAX)
    assert rel_err(dequantize_act_group(x8, scale), x) < 0.04
    x3 = x.reshape(1, 5, 300)   # leading dims are kept
    assert quantize_act_group(x3)[1].shape == (1, 5, 3)


def test_fnuz_reinterpretation_keeps_values():
    w = gaussian(128, 256)
    w[0, :4] = -0.0
    w8, scale = quantize_weight_block(w)
    q, s = fp8_e4m3fn_to_fnuz(w8, scale)
    assert q.dtype == torch.float8_e4m3fnuz
    a = w8.float() * expand_block_scale(scale, w8.shape)
    b = q.float() * expand_block_scale(s, q.shape)
    assert not torch.isnan(b).any()
    assert torch.equal(a, b)


def test_invalid_inputs_raise():
    with pytest.raises(ValueError, match="expected .N, K. or .E, N, K."):
        quantize_weight_block(torch.ones(8))
    with pytest.raises(ValueError, match="float"):
        quantize_weight_block(torch.ones(8, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="block"):
        quantize_weight_block(torch.ones(8, 8), block=0)
    w8, scale = quantize_weight_block(torch.ones(200, 200))
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_weight_block(w8, scale[:1])


def test_fp8_bytes_counts_values_and_scales():
    assert fp8_bytes((256, 384)) == 256 * 384 + 4 * 2 * 3
    assert fp8_bytes((4, 130, 10)) == 4 * 130 * 10 + 4 * 4 * 2 * 1

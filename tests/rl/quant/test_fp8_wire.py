"""FP8 on the wire: uint8 bytes + fp32 scales, about half of BF16."""
import pytest
import torch

from rl.quant.block_fp8 import dequantize_weight_block, quantize_weight_block
from rl.quant.wire import pack_fp8_for_wire, scale_name, unpack_fp8_from_wire, wire_to_fp8


def nbytes(t):
    return t.numel() * t.element_size()


@pytest.mark.parametrize("shape", [(512, 768), (4, 256, 130)])
def test_wire_bytes_are_about_half_of_bf16(shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).bfloat16()
    w_u8, scale = pack_fp8_for_wire(w)
    assert w_u8.dtype == torch.uint8 and w_u8.shape == w.shape and scale.dtype == torch.float32
    ratio = (nbytes(w_u8) + nbytes(scale)) / nbytes(w)
    assert 0.5 < ratio < 0.51


def test_wire_roundtrip_equals_local_dequantisation():
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(1))
    w_u8, scale = pack_fp8_for_wire(w, pow2=True)
    received = w_u8.clone()                 # what a broadcast delivers: plain bytes
    out = unpack_fp8_from_wire(received, scale, dtype=torch.float32)
    w8, s = quantize_weight_block(w, pow2=True)
    assert torch.equal(out, dequantize_weight_block(w8, s, dtype=torch.float32))
    assert ((out - w).norm() / w.norm()).item() < 0.04
    assert unpack_fp8_from_wire(received, scale).dtype == torch.bfloat16
    assert wire_to_fp8(received).dtype == torch.float8_e4m3fn


def test_wire_errors_and_names():
    with pytest.raises(ValueError, match="expected uint8"):
        wire_to_fp8(torch.zeros(4, 4))
    assert scale_name("model.layers.0.self_attn.q_proj.weight") == \
        "model.layers.0.self_attn.q_proj.weight_scale_inv"

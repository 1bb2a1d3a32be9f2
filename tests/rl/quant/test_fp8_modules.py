"""FP8Linear / FP8Experts and swap_linears on a tiny random Qwen3-MoE (torch reference backend)."""
import pytest
import torch
from torch import nn

from rl.quant.backends import BackendUnavailableError
from rl.quant.modules import FP8Experts, FP8Linear, swap_linears


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_fp8_linear_from_linear():
    torch.manual_seed(0)
    lin = nn.Linear(300, 200)
    q = FP8Linear.from_linear(lin)
    assert q.weight_fp8.dtype == torch.float8_e4m3fn and q.weight_scale.shape == (2, 3)
    assert set(q.state_dict()) == {"weight_fp8", "weight_scale", "bias"}
    x = torch.randn(2, 5, 300)
    with torch.no_grad():
        assert 1e-3 < rel_err(q(x), lin(x)) < 0.04
    assert "backend=torch" in repr(q)


def test_load_bf16_weight_requantises_in_place():
    torch.manual_seed(1)
    lin, other = nn.Linear(256, 128, bias=False), nn.Linear(256, 128, bias=False)
    q = FP8Linear.from_linear(lin)
    ptrs = (q.weight_fp8.data_ptr(), q.weight_scale.data_ptr())
    q.load_bf16_weight(other.weight.bfloat16())
    assert (q.weight_fp8.data_ptr(), q.weight_scale.data_ptr()) == ptrs
    x = torch.randn(4, 256)
    with torch.no_grad():
        assert rel_err(q(x), other(x)) < 0.04 and rel_err(q(x), lin(x)) > 0.5
    with pytest.raises(ValueError, match="expected \\(128, 256\\)"):
        q.load_bf16_weight(torch.zeros(256, 128))
    with pytest.raises(ValueError, match="without one"):
        q.load_bf16_weight(other.weight, torch.zeros(128))


def test_fp8_experts_match_hf_experts(tiny_qwen3_moe):
    experts = tiny_qwen3_moe.model.layers[0].mlp.experts
    q = FP8Experts.from_experts(experts)
    assert q.gate_up_fp8.shape == (4, 64, 64) and q.gate_up_scale.shape == (4, 1, 1)
    assert q.down_fp8.shape == (4, 64, 32) and q.down_scale.shape == (4, 1, 1)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(10, 64, generator=g)
    idx = torch.randint(0, 4, (10, 2), generator=g)
    wts = torch.rand(10, 2, generator=g)
    with torch.no_grad():
        ref = experts(h, idx, wts)
        out = q(h, idx, wts)
        # two FP8 GEMMs in a row (~2.7% each): the errors compound to ~4.7% here
        assert 1e-3 < rel_err(out, ref) < 0.08
        # slots marked with index E (dropped by expert parallelism in transformers) are skipped
        dropped = idx.clone()
        dropped[0, 1] = 4
        zero_w = wts.clone()
        zero_w[0, 1] = 0
        torch.testing.assert_close(q(h, dropped, wts), q(h, idx, zero_w))
    with pytest.raises(ValueError, match="not a fused"):
        FP8Experts.from_experts(nn.Linear(4, 4))


def test_swap_linears_tiny_qwen3_moe(tiny_qwen3_moe):
    model = tiny_qwen3_moe
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    report = swap_linears(model, backend="auto")
    layer0, layer1 = model.model.layers
    assert isinstance(layer0.self_attn.q_proj, FP8Linear) and isinstance(layer1.mlp.gate_proj, FP8Linear)
    assert isinstance(layer0.mlp.experts, FP8Experts)
    assert type(model.lm_head) is nn.Linear                       # kept in BF16
    assert not isinstance(layer0.mlp.gate, FP8Linear)             # router untouched
    assert report.kept == ["lm_head.weight"]
    names = {r["name"] for r in report.quantized}
    assert len(names) == 13 and "model.layers.0.mlp.experts.gate_up_proj" in names
    assert all(r["rel_err"] < 0.04 for r in report.quantized)
    assert report.bytes_fp8 < 0.55 * report.bytes_bf16
    with torch.no_grad():
        out = model(ids).logits
    # 2 layers of FP8 GEMMs on random weights: ~5% relative logit error (measured 0.051)
    assert 1e-4 < rel_err(out, ref) < 0.08
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75


def test_swap_linears_custom_keep_list_and_backend_errors(tiny_qwen3_moe):
    report = swap_linears(tiny_qwen3_moe, keep_patterns=["*self_attn*", "lm_head*"], experts=False)
    layer0 = tiny_qwen3_moe.model.layers[0]
    assert type(layer0.self_attn.q_proj) is nn.Linear
    assert not isinstance(layer0.mlp.experts, FP8Experts)
    assert {r["name"] for r in report.quantized} == {
        "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.mlp.down_proj.weight"}
    with pytest.raises(BackendUnavailableError, match="cannot run on cpu"):
        swap_linears(tiny_qwen3_moe, backend="cuda")

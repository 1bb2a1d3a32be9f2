"""Keep-in-BF16 decisions on the real HF parameter names of tiny Qwen3-MoE / DeepSeek-V3 models."""
import pytest
import torch

from rl.quant.policy import DEFAULT_KEEP_BF16, KeepPolicy, keep_in_bf16, should_quantize

QWEN3_FP8 = {
    "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
    "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
    "model.layers.1.self_attn.v_proj.weight", "model.layers.1.self_attn.o_proj.weight",
    "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
}


def test_qwen3_moe_decisions(tiny_qwen3_moe):
    params = dict(tiny_qwen3_moe.named_parameters())
    decided = {name for name, p in params.items() if should_quantize(name, p)}
    assert decided == QWEN3_FP8
    # the router is kept, the dense MLP's gate_proj is not: the classic pattern mistake
    assert "model.layers.0.mlp.gate.weight" in params
    assert not should_quantize("model.layers.0.mlp.gate.weight", params["model.layers.0.mlp.gate.weight"])
    assert keep_in_bf16("lm_head.weight") and keep_in_bf16("model.embed_tokens.weight")
    assert keep_in_bf16("model.layers.0.self_attn.q_norm.weight")


def test_deepseek_v3_decisions(tiny_deepseek_v3_meta):
    params = dict(tiny_deepseek_v3_meta.named_parameters())
    decided = {name for name, p in params.items() if should_quantize(name, p)}
    kept = set(params) - decided
    assert "model.layers.1.mlp.gate.weight" in kept
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
            "model.layers.0.self_attn.q_a_layernorm.weight",
            "model.layers.0.self_attn.kv_a_layernorm.weight"} <= kept
    assert {"model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight",
            "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
            "model.layers.1.mlp.shared_experts.gate_proj.weight",
            "model.layers.1.mlp.experts.gate_up_proj", "model.layers.0.mlp.gate_proj.weight"} <= decided
    # every kept parameter is kept for a reason: a pattern or not a matrix
    for name in kept:
        assert params[name].dim() == 1 or KeepPolicy().matching_pattern(name) is not None, name
    bias = dict(tiny_deepseek_v3_meta.named_buffers())["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert not should_quantize("model.layers.1.mlp.gate.e_score_correction_bias", bias)


def test_non_matrix_and_non_float_tensors_stay():
    assert not should_quantize("x.weight", torch.ones(8))
    assert not should_quantize("x.weight", torch.ones(8, 8, dtype=torch.int64))
    assert not should_quantize("x.weight", (0, 8))
    assert not should_quantize("x.bias", (8, 8))
    assert not should_quantize("model.layers.0.mlp.experts.scales", (4, 8, 8))
    assert should_quantize("x.weight", (8, 8))


def test_custom_patterns_glob_and_regex():
    policy = KeepPolicy([*DEFAULT_KEEP_BF16, r"re:\.layers\.0\.", "*.o_proj.weight"])
    assert not should_quantize("model.layers.0.self_attn.q_proj.weight", (64, 64), policy)
    assert not should_quantize("model.layers.3.self_attn.o_proj.weight", (64, 64), policy)
    assert should_quantize("model.layers.3.self_attn.q_proj.weight", (64, 64), policy)
    assert policy.matching_pattern("model.layers.0.x.weight") == r"re:\.layers\.0\."
    # an empty list quantises every matrix, embeddings included
    assert should_quantize("model.embed_tokens.weight", (256, 64), [])


def test_bad_patterns_raise():
    with pytest.raises(ValueError, match="invalid regex"):
        KeepPolicy(["re:("])
    with pytest.raises(ValueError, match="non-empty"):
        KeepPolicy([""])
    with pytest.raises(ValueError, match="list of patterns"):
        should_quantize("x.weight", (8, 8), "*norm*")

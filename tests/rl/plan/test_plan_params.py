"""Parameter counts by formula: published totals, and exact agreement with transformers."""
import json

import pytest

from rl.plan.arch import KEEP_BF16, KEEP_BF16_V4, ModelConfigError, fp8_bytes, fp8_eligible, parse
from rl.plan.source import KNOWN_DIR

# Published figures (model cards / technical reports). Totals have three significant figures.
TOTALS = {"DeepSeek-V3": 671e9, "DeepSeek-V4-Flash": 284e9, "Qwen3-30B-A3B": 30.5e9,
          "Qwen3-8B": 8.2e9}


@pytest.mark.parametrize("name", sorted(TOTALS))
def test_total_matches_published_within_1_percent(name, published):
    total = published(name).total_params
    assert abs(total - TOTALS[name]) / TOTALS[name] < 0.01, f"{name}: {total / 1e9:.3f}B"


def within_rounding(value: float, published_value: float, step: float) -> bool:
    """|value - published| <= half the published rounding step + 1% (two-figure figures such
    as "37B" or "3.3B" carry +-0.5 / +-0.05 of rounding before any modelling error)."""
    return abs(value - published_value) <= step / 2 + 0.01 * published_value


def test_active_parameters_match_published_conventions(published):
    # DeepSeek counts what a token multiplies by: no input embedding table (36.6B -> "37B").
    v3 = published("DeepSeek-V3")
    assert within_rounding(v3.active_params, 37e9, 1e9), v3.active_params
    assert within_rounding(published("DeepSeek-V4-Flash").active_params, 13e9, 1e9)
    # Qwen's "3.3B activated" includes the input embedding (3.04B + 0.31B).
    q = published("Qwen3-30B-A3B")
    assert within_rounding(q.active_params + q.input_embedding_params, 3.3e9, 0.1e9)
    assert not within_rounding(q.active_params, 3.3e9, 0.1e9)  # the convention matters


def test_non_embedding_counts_match_qwen_model_cards(published):
    for name, non_embedding in (("Qwen3-8B", 6.95e9), ("Qwen3-30B-A3B", 29.9e9)):
        a = published(name)
        assert abs(a.total_params - 2 * a.vocab * a.hidden - non_embedding) / non_embedding < 0.01


def test_v4_flash_layout_from_the_checkpoint_fields(v4_flash):
    # 44 compress_ratios (the last is the MTP layer) -> 43 layers: 2 sliding, 21 CSA, 20 HCA
    assert v4_flash.num_layers == 43 and len(v4_flash.layer_types) == 43
    assert v4_flash.layer_types[:4] == ("sliding_attention", "sliding_attention",
                                        "compressed_sparse_attention", "heavily_compressed_attention")
    assert v4_flash.layer_types.count("compressed_sparse_attention") == 21
    # ZeRO-3 gathers one layer's whole expert stack at once: 256 x 3 x 4096 x 2048
    assert v4_flash.largest_module() == 256 * 3 * 4096 * 2048


def test_known_configs_are_the_published_fixtures(fixtures_dir):
    shipped = {p.name for p in KNOWN_DIR.glob("*.json")}
    assert shipped == {p.name for p in fixtures_dir.glob("*.json")}
    for name in shipped:
        shipped_config = json.loads((KNOWN_DIR / name).read_text())
        assert shipped_config == json.loads((fixtures_dir / name).read_text())


def test_unsupported_or_incomplete_configs_name_the_problem(fixtures_dir):
    with pytest.raises(ModelConfigError, match="model_type 'llama' is not supported"):
        parse({"model_type": "llama"}, "x.json")
    c = json.loads((fixtures_dir / "Qwen3-8B.json").read_text())
    del c["intermediate_size"]
    with pytest.raises(ModelConfigError, match="x.json: config.json has no intermediate_size"):
        parse(c, "x.json")
    with pytest.raises(ModelConfigError, match="compress_ratios holds \\[2\\]"):
        parse({**json.loads((fixtures_dir / "DeepSeek-V4-Flash.json").read_text()),
               "compress_ratios": [2] * 44}, "v4.json")


def test_fp8_bytes_counts_values_and_block_scales():
    assert fp8_bytes((256, 384)) == 256 * 384 + 4 * 2 * 3
    assert fp8_bytes((8, 200, 130)) == 8 * 200 * 130 + 4 * 8 * 2 * 2  # per expert, ragged blocks


# ---- exact agreement with the real transformers models ------------------------------------
@pytest.fixture(scope="module", params=["tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-deepseek-v4"])
def preset_model(request):
    import torch
    torch.set_num_threads(1)
    from rl.models.presets import build_model
    return request.param, build_model(request.param)


def test_formula_equals_hf_parameters_exactly(preset_model):
    name, model = preset_model
    arch = parse(model.config.to_dict(), name)
    real = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert {t.name: t.shape for t in arch.tensors} == real
    assert arch.total_params == sum(p.numel() for p in model.parameters())


def test_fp8_rule_is_rl_quant_policy(preset_model):
    from rl.quant.policy import DEFAULT_KEEP_BF16, should_quantize
    assert KEEP_BF16 == DEFAULT_KEEP_BF16
    name, model = preset_model
    arch = parse(model.config.to_dict(), name)
    for t in arch.tensors:
        ours = fp8_eligible(t.name, t.shape, arch.model_type)
        v4_kept = arch.model_type == "deepseek_v4" and t.name.endswith(
            tuple(p.lstrip("*") for p in KEEP_BF16_V4))
        assert ours == (should_quantize(t.name, t.shape) and not v4_kept), t.name


def test_v4_legacy_checkpoint_fields_parse_like_the_modern_ones():
    from rl.models.presets import preset_config
    modern = preset_config("tiny-deepseek-v4", 128).to_dict()
    assert modern["layer_types"][1:3] == ["compressed_sparse_attention", "heavily_compressed_attention"]
    legacy = {k: v for k, v in modern.items() if k not in ("layer_types", "mlp_layer_types",
                                                           "compress_rates")}
    legacy.update(compress_ratios=[0, 4, 128, 4], num_hash_layers=1)
    assert parse(legacy, "legacy").tensors == parse(modern, "modern").tensors


def test_dense_qwen3_formula_equals_hf():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model("qwen3", vocab_size=96, hidden_size=64, intermediate_size=160,
                                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, attention_bias=True, tie_word_embeddings=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    arch = parse(config.to_dict(), "tiny-qwen3")
    assert {t.name: t.shape for t in arch.tensors} == {n: tuple(p.shape)
                                                       for n, p in model.named_parameters()}

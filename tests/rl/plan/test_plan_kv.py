"""KV-cache bytes per token: hand-computed small cases, and transformers' own caches."""
import pytest

from rl.config import ConfigError
from rl.plan.arch import parse
from rl.plan.kv import kv_layout


def gqa_config(kv_heads=2, head_dim=32, layers=4):
    return {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 128, "intermediate_size": 256,
            "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": kv_heads,
            "head_dim": head_dim}


def test_gqa_per_token_and_tensor_parallel_split():
    arch = parse(gqa_config(), "gqa")
    # 2 (K, V) x 2 heads x 32 x 4 layers x 2 B
    assert kv_layout(arch, tp=1, dtype_bytes=2).per_token == 2 * 2 * 32 * 4 * 2 == 1024
    assert kv_layout(arch, tp=2, dtype_bytes=2).per_token == 512      # one head per rank
    assert kv_layout(arch, tp=4, dtype_bytes=2).per_token == 512      # replicated, not 256
    assert kv_layout(arch, tp=1, dtype_bytes=1).per_token == 512      # fp8 cache
    assert kv_layout(arch, tp=1, dtype_bytes=2).per_sequence == 0


def test_mla_latent_is_replicated_across_ranks():
    arch = parse({"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 128,
                  "num_hidden_layers": 3, "num_attention_heads": 8, "q_lora_rank": 64,
                  "kv_lora_rank": 512, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64,
                  "v_head_dim": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 64, "intermediate_size": 256,
                  "first_k_dense_replace": 1}, "mla")
    for tp in (1, 8):
        assert kv_layout(arch, tp, 2).per_token == (512 + 64) * 3 * 2 == 3456


def test_deepseek_v3_published_latent(published):
    assert kv_layout(published("DeepSeek-V3"), 8, 2).per_token == 576 * 61 * 2  # 68.6 KiB


V4_TINY = {"model_type": "deepseek_v4", "vocab_size": 64, "hidden_size": 128, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 64,
           "o_groups": 2, "o_lora_rank": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 64, "index_n_heads": 8, "index_head_dim": 128,
           "sliding_window": 16, "hc_mult": 2, "compress_ratios": [0, 4, 128, 4]}


def test_v4_compressed_layers_and_windows():
    kv = kv_layout(parse(V4_TINY, "v4"), tp=8, dtype_bytes=2)
    csa = (512 + 128) / 4 * 2      # one head_dim entry + one indexer key per 4 tokens
    hca = 512 / 128 * 2            # one head_dim entry per 128 tokens
    assert kv.per_token == 2 * csa + hca == 648
    assert kv.per_sequence == 4 * 16 * 512 * 2  # every layer's sliding window
    assert kv.sequence_bytes(1000) == 648 * 1000 + 65536


def test_v4_flash_per_token(v4_flash):
    kv = kv_layout(v4_flash, tp=8, dtype_bytes=2)
    assert kv.per_token == 21 * 320 + 20 * 8 == 6880
    assert kv.per_sequence == 43 * 128 * 512 * 2


def test_v4_fp8_ds_mla_is_what_vllm_v4_allocates(v4_flash):
    """vLLM's V4 on GPUs packs each entry in 584 B (attention.py `state_content_bytes`, the
    SWA cache's `packed_bytes_per_token`) and each FP8 indexer key in 128 + 4 B; auto and fp8
    become this layout, bfloat16 keeps plain 2-byte rows."""
    tiny = parse(V4_TINY, "v4")
    for dtype in ("fp8_ds_mla", "auto", "fp8"):
        kv = kv_layout(tiny, tp=8, dtype_bytes=2, cache_dtype=dtype)
        assert kv.per_token == 2 * (584 + 132) / 4 + 584 / 128 == 362.5625
        assert kv.per_sequence == 4 * 16 * 584
    assert kv_layout(tiny, 8, 2, cache_dtype="bfloat16").per_token == 648
    flash = kv_layout(v4_flash, tp=8, dtype_bytes=1, cache_dtype="fp8_ds_mla")
    assert flash.per_token == 21 * 179 + 20 * 584 / 128 == 3850.25      # 3.8 KiB, not 6.7


def test_fp8_ds_mla_on_another_model_is_a_config_error():
    with pytest.raises(ConfigError, match=r"rollout\.kv_cache_dtype: 'fp8_ds_mla' .*'qwen3'"):
        kv_layout(parse(gqa_config(), "gqa"), 1, 1, cache_dtype="fp8_ds_mla")


# ---- against transformers' caches (fp32 models: 4 bytes per element) -----------------------
def _cache(name: str, tokens: int):
    import torch
    torch.set_num_threads(1)
    from rl.models.presets import build_model
    model = build_model(name)
    ids = torch.randint(3, model.config.vocab_size, (1, tokens))
    with torch.no_grad():
        return model, model(input_ids=ids, use_cache=True).past_key_values


def test_gqa_formula_equals_hf_cache_bytes():
    model, cache = _cache("tiny-qwen3-moe", 24)
    held = sum(t.numel() * t.element_size()
               for layer in cache.layers for t in (layer.keys, layer.values))
    assert held == 24 * kv_layout(parse(model.config.to_dict(), "q"), tp=1, dtype_bytes=4).per_token


def test_v4_growth_per_token_equals_hf_compressed_cache():
    """What the HF V4 cache keeps beyond its windows: compressor entries (CSA and HCA) and the
    indexer's keys. Between 256 and 512 tokens it grows by exactly the planner's per-token bytes."""
    def compressed_bytes(tokens):
        model, cache = _cache("tiny-deepseek-v4", tokens)
        total = 0
        for layer in cache.layers:
            for t in getattr(layer, "compressed_kv", {}).values():
                total += 0 if t is None else t.numel() * t.element_size()
        return model, total
    model, small = compressed_bytes(256)
    _, large = compressed_bytes(512)
    kv = kv_layout(parse(model.config.to_dict(), "v4"), tp=1, dtype_bytes=4)
    assert large - small == pytest.approx(256 * kv.per_token)

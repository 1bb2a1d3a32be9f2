"""`rollout.kv_cache_dtype` is one setting for the engine and the memory plan."""
import pytest
import torch

from rl.config import ConfigError, load_config

V4 = "configs/deepseek_v4_flash_3node.yaml"


def test_the_engine_gets_the_dtype_the_plan_assumes(tmp_path):
    from rl.rollout.vllm_engine import engine_kwargs
    cfg = load_config(None, ["rollout.kv_cache_dtype=fp8"])
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe"}')
    kwargs = engine_kwargs(tmp_path, cfg.rollout, torch.device("cpu"), torch.float32)
    assert kwargs["kv_cache_dtype"] == "fp8"


def test_the_plan_sizes_the_kv_cache_from_the_same_key():
    from rl.plan import arch, source
    from rl.plan.memory import plan_rollout

    def rollout(*overrides):
        cfg = load_config(V4, list(overrides))
        config, where, _ = source.model_config(cfg)
        return plan_rollout(cfg, arch.parse(config, where))
    # The V4 config says fp8_ds_mla, vLLM's V4 cache (584 B entries, 132 B indexer keys);
    # fp8 is vLLM's alias for it on V4; bfloat16 rows take 2 B per value.
    packed, alias = rollout(), rollout("rollout.kv_cache_dtype=fp8")
    bf16 = rollout("rollout.kv_cache_dtype=bfloat16")
    assert packed.kv.per_token == alias.kv.per_token == 21 * (584 + 132) / 4 + 20 * 584 / 128
    assert bf16.kv.per_token == 21 * (512 + 128) / 4 * 2 + 20 * 512 / 128 * 2
    assert packed.concurrent > 1.6 * bf16.concurrent


def test_fp8_kv_only_where_an_engine_has_it_and_old_key_says_where_it_went(tmp_path):
    with pytest.raises(ConfigError, match="rollout.kv_cache_dtype: got 'fp8', expected 'auto' or "
                                          "'bfloat16' with engine 'hf'"):
        load_config(None, ["rollout.engine=hf", "rollout.kv_cache_dtype=fp8"])
    with pytest.raises(ConfigError, match="rollout.kv_cache_dtype: got 'fp8_ds_mla', expected "
                                          "'auto', 'bfloat16' or 'fp8' with engine 'native'"):
        load_config(None, ["rollout.engine=native", "rollout.kv_cache_dtype=fp8_ds_mla"])
    assert load_config(None, ["rollout.engine=native", "rollout.kv_cache_dtype=fp8"]
                       ).rollout.kv_cache_dtype == "fp8"
    old = tmp_path / "old.yaml"
    old.write_text("plan:\n  kv_cache_dtype: fp8\n")
    with pytest.raises(ConfigError, match=r"old.yaml:plan.kv_cache_dtype: this key moved to "
                                          r"rollout.kv_cache_dtype"):
        load_config(old)

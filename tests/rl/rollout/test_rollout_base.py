"""Unit tests of the engine-independent pieces: sampling params, seeds, stops, vLLM arguments."""
import json

import pytest
import torch

from rl.config import ConfigError, RolloutConfig
from rl.rollout import create_engine
from rl.rollout.base import (
    SamplingParams, check_token_lists, check_version, cut_at_stop, prompt_seeds, read_eos_ids,
)
from rl.rollout.vllm_engine import engine_kwargs


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5),
                                    dict(top_k=0), dict(max_new_tokens=0), dict(n=0),
                                    dict(seed=-1)])
def test_sampling_params_reject_bad_values(kwargs):
    with pytest.raises(ValueError, match="SamplingParams"):
        SamplingParams(**kwargs)


def test_sampling_params_greedy_only_at_zero_temperature():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.01).greedy


def test_prompt_seeds_are_deterministic_distinct_and_fit_int63():
    a, b = prompt_seeds(7, 64), prompt_seeds(7, 64)
    assert a == b
    assert len(set(a)) == 64
    assert all(0 <= s < 2**62 for s in a)
    assert prompt_seeds(7, 3) == a[:3]  # a prefix does not depend on how many prompts follow
    # vLLM seeds sample k of a request with seed + k: the windows of neighbouring base seeds
    # (the driver gives engine i the seed + i) must not overlap.
    windows = [set(range(s, s + 64)) for s in prompt_seeds(7, 8) + prompt_seeds(8, 8)]
    assert sum(len(w) for w in windows) == len(set().union(*windows))


def test_cut_at_stop_keeps_the_first_stop_token():
    assert cut_at_stop([5, 6, 2, 7, 2], {2}) == ([5, 6, 2], "stop")
    assert cut_at_stop([5, 6, 7], {2}) == ([5, 6, 7], "length")
    assert cut_at_stop([9], {2, 9}) == ([9], "stop")


def test_read_eos_ids_prefers_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert read_eos_ids(tmp_path) == [5]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 3, 7]}))
    assert read_eos_ids(tmp_path) == [3, 7]


def test_check_token_lists_names_the_bad_entry():
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] holds token id 200"):
        check_token_lists("prompt_ids", [[1, 2], [3, 200]], vocab_size=128)
    with pytest.raises(ValueError, match=r"prompt_ids\[0\] is empty"):
        check_token_lists("prompt_ids", [[]], vocab_size=128)
    check_token_lists("response_ids", [[]], vocab_size=128, allow_empty=True)


def test_weight_versions_never_go_backwards():
    check_version(3, 3)
    check_version(3, 4)
    with pytest.raises(ValueError, match="backwards"):
        check_version(3, 2)


def test_create_engine_rejects_unknown_kinds(tmp_path):
    with pytest.raises(ConfigError, match="rollout.engine: got 'sglang'"):
        create_engine("sglang", tmp_path, RolloutConfig())


def test_vllm_fp8_on_cpu_is_a_config_error(tmp_path):
    cfg = RolloutConfig(quantization="fp8")
    with pytest.raises(ConfigError, match="rollout.quantization: got 'fp8'.*no CPU kernel"):
        engine_kwargs(tmp_path, cfg, torch.device("cpu"), torch.float32)


def test_vllm_engine_kwargs_follow_the_config(tmp_path):
    cfg = RolloutConfig(quantization="fp8", tensor_parallel_size=2, max_model_len=1024,
                        gpu_memory_utilization=0.5, cpu_kvcache_gb=1.5, seed=9)
    gpu = engine_kwargs(tmp_path, cfg, torch.device("cuda"), torch.bfloat16)
    assert (gpu["quantization"], gpu["dtype"]) == ("fp8", "bfloat16")
    assert gpu["tensor_parallel_size"] == 2
    assert (gpu["gpu_memory_utilization"], gpu["max_model_len"], gpu["seed"]) == (0.5, 1024, 9)
    assert gpu["logprobs_mode"] == "raw_logprobs"
    assert gpu["worker_extension_cls"] == "rl.rollout.vllm_ext.WeightSyncExtension"
    assert gpu["skip_tokenizer_init"] and "tokenizer" not in gpu  # no tokenizer files there
    cpu = engine_kwargs(tmp_path, RolloutConfig(cpu_kvcache_gb=1.5), torch.device("cpu"),
                        torch.float32)
    assert cpu["kv_cache_memory_bytes"] == int(1.5 * 2**30) and cpu["quantization"] is None
    assert "gpu_memory_utilization" not in cpu
    # vLLM-CPU cannot rewind the generator of a seeded, partly prefilled request; CUDA can.
    assert cpu["enable_chunked_prefill"] is False and "enable_chunked_prefill" not in gpu
    (tmp_path / "tokenizer.json").write_text("{}")
    with_tokenizer = engine_kwargs(tmp_path, cfg, torch.device("cuda"), torch.bfloat16)
    assert with_tokenizer["tokenizer"] == str(tmp_path)

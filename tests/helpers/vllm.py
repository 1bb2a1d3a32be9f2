"""One factory for in-process vLLM-CPU engines, shared by every test that needs one.

vLLM-CPU init is ~60 s on 2 cores: build one engine per model per test session (a
session-scoped fixture calling `make_vllm_llm`) and reuse it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# Keep the V1 engine core in this process: no spawned children (which would need a __main__
# guard in scripts and leave processes behind when a test fails).
_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default (4) is wasteful for tiny models
    "HF_HUB_OFFLINE": "1",
}


def make_vllm_llm(model_dir: str | Path, **kw: Any):
    """A `vllm.LLM` over the HF directory `model_dir`, set up for CPU equivalence tests.

    Defaults (each overridable through `kw`): fp32, eager (no torch.compile / graphs), a small
    `max_model_len`, seed 0, at most 64 sequences per batch, plus the model's
    `rl.models.loading.vllm_cpu_overrides` for its dtype (torch rotary for MLA models, and their
    `CPU_MLA` backend unless bf16). Returns the `vllm.LLM`.
    """
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    from vllm import LLM

    from rl.models.loading import vllm_cpu_overrides

    args: dict[str, Any] = dict(
        model=str(model_dir), tokenizer=str(model_dir), dtype="float32", enforce_eager=True,
        max_model_len=256, max_num_seqs=64, seed=0, trust_remote_code=False)
    args.update(kw)
    overrides = vllm_cpu_overrides(Path(model_dir), _dtype(args["dtype"]))
    args.update({k: v for k, v in overrides.items() if k not in kw})
    return LLM(**args)


def _dtype(dtype: str | "torch.dtype"):
    import torch

    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)


def attention_backends(llm) -> set[str]:
    """Names of the attention backends an in-process `vllm.LLM`'s model runs (e.g. "CPU_MLA")."""
    def names(worker) -> set[str]:
        return {m.attn_backend.get_name() for m in worker.model_runner.model.modules()
                if hasattr(m, "attn_backend")}

    return llm.collective_rpc(names)[0]


def hf_greedy(model, prompt_ids: list[int], num_tokens: int) -> tuple[list[int], list[float], list[float]]:
    """Greedy continuation of `prompt_ids` by an HF causal LM, by full forwards (no KV cache).

    Returns (tokens, logprobs of those tokens, margins): margin[i] is top-1 minus top-2 log-prob at
    step i, so a comparison can tell a real mismatch from an argmax near-tie. EOS is not special.
    """
    import torch

    x = torch.tensor([prompt_ids])
    tokens, logprobs, margins = [], [], []
    with torch.no_grad():
        for _ in range(num_tokens):
            lp = model(x).logits[0, -1].float().log_softmax(-1)
            top = lp.topk(2)
            tokens.append(int(top.indices[0]))
            logprobs.append(float(top.values[0]))
            margins.append(float(top.values[0] - top.values[1]))
            x = torch.cat([x, top.indices[:1].view(1, 1)], dim=1)
    return tokens, logprobs, margins


def assert_greedy_match(engine_tokens: list[int], engine_logprobs: list[float],
                        hf_tokens: list[int], hf_logprobs: list[float], hf_margins: list[float],
                        *, atol: float) -> int:
    """Check an engine's greedy tokens against `hf_greedy`'s; return how many steps matched.

    Tokens must be equal until a step where HF's top-2 margin is below `2 * atol` (an argmax
    near-tie, which numerical noise may break either way); comparison stops there, since the two
    continuations legitimately diverge. While they agree, each step's log-prob must match within
    `atol`.
    """
    for i, (got, want) in enumerate(zip(engine_tokens, hf_tokens)):
        if got != want:
            assert hf_margins[i] < 2 * atol, (
                f"step {i}: engine token {got} != HF token {want} with HF margin "
                f"{hf_margins[i]:.4g} (not a near-tie); engine {engine_tokens}, HF {hf_tokens}")
            return i
        assert abs(engine_logprobs[i] - hf_logprobs[i]) < atol, (
            f"step {i}: log-prob {engine_logprobs[i]:.5f} (engine) vs {hf_logprobs[i]:.5f} (HF)")
    return len(hf_tokens)


def greedy_in_subprocess(model_dir: str | Path, prompt_ids: list[list[int]], num_tokens: int,
                         probe: str, timeout_s: float = 900) -> dict:
    """Greedy vLLM-CPU generation in a fresh process (`rl.rollout.vllm_probe`, which is also the
    probe of whether vLLM can run this model on this CPU at all).

    Returns its answer: {"ok": True, "tokens", "logprobs"} or {"ok": False, "stage", "error"}. A
    failure is remembered under `.cache/probes/<probe>-<machine key>.json`, so later sessions
    (and `launch.submit`'s check) on the same CPU and versions answer at once.
    """
    from rl.rollout.vllm_probe import run_probe

    return run_probe(model_dir, prompt_ids, num_tokens, probe, timeout_s)

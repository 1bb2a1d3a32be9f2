"""The `vllm` rollout engine: vLLM's offline `LLM`, weights replaced in place between steps.

Choices, and why:
- The V1 engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, unless the
  environment already says otherwise): no child processes to orphan inside a Ray actor, and
  `collective_rpc` hands tensors to the worker by reference. Tensor parallelism still spawns
  one worker process per GPU. In-process, vLLM seeds the process-wide RNGs with `cfg.seed`.
- `logprobs_mode="raw_logprobs"`: returned log-probs are log_softmax of the raw logits, at
  temperature 1 and before top-p/top-k (the convention of `rl.rollout.base`).
- Prefix caching stays on (the n samples of a prompt share its prefill); every weight update
  resets it so no KV computed by old weights is served.
- `score` uses `prompt_logprobs` over prompt + response: the same forward as prefill.
- CPU: fp32 by default (bit-for-bit close to the fp32 trainer); the KV cache is sized by
  `cpu_kvcache_gb` through `kv_cache_memory_bytes` (the legacy `VLLM_CPU_KVCACHE_SPACE`
  takes whole GiB only and, when set, wins).
- CPU: chunked prefill off. Every request carries its own seed (`prompt_seeds`), so vLLM gives
  it its own `torch.Generator`. When a step's prompt tokens exceed the batched-token budget
  (4096 on CPU), the scheduler prefills the last admitted request only partly; vLLM samples a
  token for it anyway, discards it and rewinds the generator with `set_offset`
  (`GPUModelRunner._bookkeeping_sync`), which a CPU generator refuses: `RuntimeError: CPU
  Generator does not use offset`. Without chunking a prompt is prefilled whole or waits for the
  next step (vLLM raises the budget to at least `max_model_len`), so no draw is ever discarded
  and a request's samples depend only on its seed, not on what shares its batch. CUDA
  generators can rewind, so GPUs keep chunked prefill.
"""
from __future__ import annotations

import gc
import json
import logging
import os
from pathlib import Path
from typing import Iterable

import torch

from rl.config import ConfigError, RolloutConfig
from rl.quant.backends import vllm_engine_env
from rl.rollout.base import (
    Sample, SamplingParams, check_score_args, check_token_lists, check_version, decode_response,
    has_tokenizer, prompt_seeds, read_eos_ids, resolve_device, resolve_dtype, special_markers,
)

log = logging.getLogger(__name__)

EXTENSION = "rl.rollout.vllm_ext.WeightSyncExtension"


def _engine_checkpoint(model_dir: str | Path, cfg: RolloutConfig) -> tuple[Path, bool]:
    """The directory vLLM is built from (`rollout.model_path`, else the trainer's model) and
    whether its config.json carries a quantization_config."""
    path = Path(cfg.model_path or model_dir)
    if cfg.model_path is not None and not (path / "config.json").is_file():
        raise ConfigError(f"rollout.model_path: {str(path)!r} has no config.json (expected the "
                          "directory `python -m launch.convert SRC --rollout-out DIR` writes)")
    config = path / "config.json"
    return path, config.is_file() and "quantization_config" in json.loads(config.read_text())


def engine_kwargs(model_dir: str | Path, cfg: RolloutConfig, device: torch.device,
                  dtype: torch.dtype) -> dict:
    """Arguments of `vllm.LLM` for this config (pure: no vLLM import, no environment change)."""
    on_cpu = device.type == "cpu"
    if cfg.quantization == "fp8" and on_cpu:
        raise ConfigError("rollout.quantization: got 'fp8', expected 'none' on a CPU machine "
                          "(vLLM's FP8 path has no CPU kernel: _C::static_scaled_fp8_quant)")
    model_dir, prequantized = _engine_checkpoint(model_dir, cfg)
    kwargs = dict(
        model=str(model_dir), dtype=str(dtype).removeprefix("torch."),
        tensor_parallel_size=cfg.tensor_parallel_size,
        # A pre-quantized checkpoint says its own method (DeepSeek-V4: deepseek_v4_fp8).
        quantization="fp8" if cfg.quantization == "fp8" and not prequantized else None,
        max_model_len=cfg.max_model_len, enforce_eager=cfg.enforce_eager, seed=cfg.seed,
        worker_extension_cls=EXTENSION, logprobs_mode="raw_logprobs",
        enable_prefix_caching=True, disable_log_stats=True,
        # One setting for the engine and the memory plan (rl.plan reads the same key).
        kv_cache_dtype=cfg.kv_cache_dtype)
    if has_tokenizer(model_dir):
        kwargs["tokenizer"] = str(model_dir)
    else:
        kwargs["skip_tokenizer_init"] = True
    if on_cpu:
        kwargs["kv_cache_memory_bytes"] = int(cfg.cpu_kvcache_gb * 2**30)
        kwargs["enable_chunked_prefill"] = False  # seeded CPU generators (module docstring)
        # MLA models: vLLM's torch rotary, and CPU_MLA unless bf16 (see vllm_cpu_overrides).
        if (Path(model_dir) / "config.json").is_file():
            from rl.models.loading import vllm_cpu_overrides
            kwargs.update(vllm_cpu_overrides(Path(model_dir), dtype))
    else:
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    return kwargs


def _configure_environment(cfg: RolloutConfig) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    is_rocm = bool(getattr(torch.version, "hip", None))
    if cfg.use_aiter and not is_rocm:
        log.warning("rollout.use_aiter=true is ignored: AITER kernels exist only on ROCm")
    os.environ.update(vllm_engine_env(cfg.use_aiter, is_rocm))
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        log.warning("VLLM_CPU_KVCACHE_SPACE=%s overrides rollout.cpu_kvcache_gb=%s",
                    os.environ["VLLM_CPU_KVCACHE_SPACE"], cfg.cpu_kvcache_gb)


class VLLMEngine:
    """Rollout engine around one `vllm.LLM` in this process."""

    def __init__(self, model_dir: str | Path, cfg: RolloutConfig, *, dtype: str = "auto",
                 device: str = "auto"):
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        kwargs = engine_kwargs(self.model_dir, cfg, self.device, self.dtype)
        _configure_environment(cfg)
        from vllm import LLM

        self.llm = LLM(**kwargs)
        self.detokenize = "tokenizer" in kwargs
        self.tokenizer = self.llm.get_tokenizer() if self.detokenize else None
        self.special_markers = special_markers(self.tokenizer) if self.detokenize else {}
        """Reasoning markers vLLM's `skip_special_tokens` decode drops (`rl.rollout.base`)."""
        self.eos_ids = read_eos_ids(self.model_dir)
        self.vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        self.weight_version = 0

    # ---- generation --------------------------------------------------------------------
    def _vllm_params(self, sampling: SamplingParams, seed: int):
        from vllm import SamplingParams as VSP

        # vLLM refuses n > 1 with greedy sampling; greedy samples are copies anyway.
        return VSP(n=1 if sampling.greedy else sampling.n, temperature=sampling.temperature,
                   top_p=sampling.top_p, top_k=0 if sampling.top_k == -1 else sampling.top_k,
                   max_tokens=sampling.max_new_tokens, seed=seed,
                   stop_token_ids=sorted(set(self.eos_ids) | set(sampling.stop_token_ids)),
                   logprobs=0, detokenize=self.detokenize, skip_special_tokens=True)

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams
                 ) -> list[list[Sample]]:
        check_token_lists("prompt_ids", prompt_ids, self.vocab_size)
        if not prompt_ids:
            return []
        self._check_fits("generate: prompt", [len(p) for p in prompt_ids],
                         "lower data.max_prompt_tokens or raise rollout.max_model_len")
        seeds = prompt_seeds(sampling.seed, len(prompt_ids))
        params = [self._vllm_params(sampling, s) for s in seeds]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompt_ids], params,
                                 use_tqdm=False)
        groups = []
        for p, out in zip(prompt_ids, outs):
            completions = sorted(out.outputs, key=lambda c: c.index)
            if sampling.greedy:
                completions = completions * sampling.n
            groups.append([self._sample(p, c) for c in completions])
        if sampling.return_routing:
            samples = [s for g in groups for s in g]
            for s, r in zip(samples, self.routing([s.prompt_ids for s in samples],
                                                  [s.response_ids for s in samples])):
                s.routing = r
        return groups

    def routing(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list:
        """Each sequence's routing (`rl.rollout.routing`): prompt + response[:-1] prefilled in one
        request each (prefix cache not read, so every row is computed), routers hooked by the
        worker extension. Requests run first come, first served and chunked prefill is off, so
        the captured rows are the requests' tokens in order (the row count is checked)."""
        from vllm import SamplingParams as VSP

        from rl.models.routing import routing_dtype
        from rl.rollout.routing import routing_rows, split_rows

        seqs = [list(p) + list(r[:-1]) for p, r in zip(prompt_ids, response_ids)]
        lengths = [routing_rows(len(p), len(r)) for p, r in zip(prompt_ids, response_ids)]
        if min(lengths, default=1) < 1:
            raise ValueError("routing: a sample with a 1-token prompt and no response has no rows")
        # Hooked only for this pass: generation and scoring run without the per-layer copies.
        layers = self.llm.collective_rpc("rl_routing_capture", args=(True,))[0]
        try:
            params = VSP(max_tokens=1, temperature=0.0, detokenize=False,
                         skip_reading_prefix_cache=True)
            self.llm.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
            taken = self.llm.collective_rpc("rl_routing_take")[0]
        finally:
            self.llm.collective_rpc("rl_routing_capture", args=(False,))
        routing_TNK = torch.stack([taken[layer] for layer in layers], dim=1)
        num_experts = self.llm.llm_engine.model_config.get_num_experts()
        return split_rows(routing_TNK, lengths, routing_dtype(num_experts))

    def _sample(self, prompt: list[int], c) -> Sample:
        """A Sample from one vLLM CompletionOutput (the stop token is in token_ids, not text)."""
        tokens = list(c.token_ids)
        if c.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM ended a sample with finish_reason={c.finish_reason!r} "
                               "(expected stop or length)")
        text = c.text or ""
        if not self.special_markers.keys().isdisjoint(tokens):
            text = decode_response(self.tokenizer, tokens, c.finish_reason)
        return Sample(prompt_ids=list(prompt), response_ids=tokens, text=text,
                      logprobs=[float(c.logprobs[j][t].logprob) for j, t in enumerate(tokens)],
                      finish_reason=c.finish_reason, weight_version=self.weight_version)

    def _check_fits(self, what: str, lengths: list[int], hint: str = "") -> None:
        """vLLM refuses inputs that leave no room for one generated token; say which and why."""
        limit = self.cfg.max_model_len - 1
        for i, n in enumerate(lengths):
            if n > limit:
                raise ValueError(f"{what} {i} has {n} tokens; at most {limit} fit "
                                 f"rollout.max_model_len={self.cfg.max_model_len}"
                                 + (f" ({hint})" if hint else ""))

    # ---- scoring -----------------------------------------------------------------------
    def score(self, prompt_ids: list[list[int]], response_ids: list[list[int]]
              ) -> list[list[float]]:
        """Raw temperature-1 log-probs of the response tokens, from `prompt_logprobs`."""
        from vllm import SamplingParams as VSP

        check_score_args(prompt_ids, response_ids, self.vocab_size)
        todo = [i for i, r in enumerate(response_ids) if r]
        self._check_fits("score: prompt + response", [len(p) + len(r) if r else 0
                                                      for p, r in zip(prompt_ids, response_ids)])
        params = VSP(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": list(prompt_ids[i]) + list(response_ids[i])}
                                  for i in todo], params, use_tqdm=False)
        result: list[list[float]] = [[] for _ in prompt_ids]
        for i, out in zip(todo, outs):
            start, seq = len(prompt_ids[i]), out.prompt_token_ids
            result[i] = [float(out.prompt_logprobs[j][seq[j]].logprob)
                         for j in range(start, len(seq))]
        return result

    # ---- weights -----------------------------------------------------------------------
    def _after_update(self, version: int) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update "
                               "(requests still running?); stale KV could be served")
        self.weight_version = version

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
                     ) -> None:
        check_version(self.weight_version, version)
        self.llm.collective_rpc("rl_load_weights", args=(list(named_tensors),))
        self._after_update(version)

    def init_weight_sync(self, host: str, port: int, world_size: int, rank: int, backend: str,
                         timeout_s: float) -> None:
        self.llm.collective_rpc("rl_init_weight_sync",
                                args=(host, port, world_size, rank, backend, timeout_s))

    @property
    def num_sync_ranks(self) -> int:
        """Ranks this engine takes in the sync group: one per tensor-parallel worker."""
        return self.cfg.tensor_parallel_size

    def receive_weights(self, plan, version: int, verify: bool = False) -> dict:
        check_version(self.weight_version, version)
        stats = self.llm.collective_rpc("rl_receive_weights", args=(plan, version, verify))
        self._after_update(version)
        out = dict(stats[0])
        out["weight_version"] = version
        return out

    def shutdown(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        try:
            llm.collective_rpc("rl_close_weight_sync")
        finally:
            llm.llm_engine.engine_core.shutdown()
            self.llm = None
            gc.collect()

"""The `hf` rollout engine: transformers `generate`, the reference implementation and fallback.

Generation is batched with left padding; sampling draws from one torch RNG stream seeded with
`sampling.seed` for the call (forked, so the process-wide RNG is untouched). Unlike vLLM the
draws depend on how prompts are batched together: same call, same samples; a different batch
of prompts gives different samples for the same prompt.

Log-probs are recomputed after generation by one full forward pass over prompt + response
(`score`): the raw temperature-1 values the trainer computes (see `rl.rollout.base`), in memory
bounded by `score_batch_tokens`, where keeping generate's per-step logits would cost
steps x batch x vocab floats.

Leaves out: continuous batching, KV-cache reuse across calls, tensor parallelism.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterable

import torch

from rl.config import RolloutConfig
from rl.rollout.base import (
    Sample, SamplingParams, check_score_args, check_token_lists, check_version, cut_at_stop,
    decode_response, has_tokenizer,
    read_eos_ids, resolve_device, resolve_dtype,
)
from rl.rollout.hf_weights import HFWeightTargets
from rl.rollout.routing import routing_rows
from rl.rollout.weights import WeightReceiver, receive_stream

log = logging.getLogger(__name__)


class HFEngine(WeightReceiver):
    """Rollout engine around an HF causal LM held in this process."""

    def __init__(self, model_dir: str | Path, cfg: RolloutConfig, *, dtype: str = "auto",
                 device: str = "auto", score_batch_tokens: int = 16384):
        from rl.models.loading import load_model, load_tokenizer

        if cfg.quantization != "none":
            log.warning("rollout.quantization=%s is ignored by the hf engine (it runs %s)",
                        cfg.quantization, dtype)
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model = load_model(self.model_dir, self.dtype, self.device)
        self.tokenizer = load_tokenizer(self.model_dir) if has_tokenizer(self.model_dir) else None
        self.vocab_size = int(self.model.config.vocab_size)
        self.eos_ids = read_eos_ids(self.model_dir)
        pad = self.tokenizer.pad_token_id if self.tokenizer is not None else None
        if pad is None:
            pad = self.model.config.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.eos_ids or [0])[0])
        self.score_batch_tokens = score_batch_tokens
        self.weight_version = 0
        self._targets = HFWeightTargets(self.model)
        self._routers = None

    # ---- generation --------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams
                 ) -> list[list[Sample]]:
        from transformers import GenerationConfig

        check_token_lists("prompt_ids", prompt_ids, self.vocab_size)
        if not prompt_ids:
            return []
        stop_ids = sorted(set(self.eos_ids) | set(sampling.stop_token_ids))
        width = max(len(p) for p in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for i, p in enumerate(prompt_ids):
            input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attention[i, width - len(p):] = 1
        # Greedy samples are all equal: decode once per prompt, then copy.
        draws = 1 if sampling.greedy else sampling.n
        knobs = {} if sampling.greedy else dict(
            temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=0 if sampling.top_k == -1 else sampling.top_k)
        gen = GenerationConfig(do_sample=not sampling.greedy,
                               max_new_tokens=sampling.max_new_tokens, num_return_sequences=draws,
                               eos_token_id=stop_ids or None, pad_token_id=self.pad_id, **knobs)
        devices = []
        if self.device.type == "cuda":
            devices = [self.device.index if self.device.index is not None
                       else torch.cuda.current_device()]
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(sampling.seed)
            out = self.model.generate(input_ids=input_ids.to(self.device),
                                      attention_mask=attention.to(self.device),
                                      generation_config=gen)
        stop_set = set(stop_ids)
        cut = [cut_at_stop(row, stop_set) for row in out[:, width:].tolist()]
        flat_prompts = [p for p in prompt_ids for _ in range(draws)]
        logprobs, routing = self._score(flat_prompts, [tokens for tokens, _ in cut],
                                        sampling.return_routing)
        groups = []
        for i, p in enumerate(prompt_ids):
            group = []
            for k in range(sampling.n):
                j = i * draws + (0 if sampling.greedy else k)
                tokens, reason = cut[j]
                group.append(Sample(prompt_ids=list(p), response_ids=list(tokens),
                                    text=self._decode(tokens, reason), logprobs=list(logprobs[j]),
                                    finish_reason=reason, weight_version=self.weight_version,
                                    routing=routing[j] if routing else None))
            groups.append(group)
        return groups

    def _decode(self, tokens: list[int], reason: str) -> str:
        return decode_response(self.tokenizer, tokens, reason)

    # ---- scoring -----------------------------------------------------------------------
    @torch.no_grad()
    def score(self, prompt_ids: list[list[int]], response_ids: list[list[int]]
              ) -> list[list[float]]:
        """Raw temperature-1 log-probs of each response token; right-padded micro-batches."""
        return self._score(prompt_ids, response_ids, False)[0]

    def _score(self, prompt_ids: list[list[int]], response_ids: list[list[int]],
               want_routing: bool) -> tuple[list[list[float]], list | None]:
        """Log-probs, and with `want_routing` each sequence's routing (`rl.rollout.routing`)."""
        check_score_args(prompt_ids, response_ids, self.vocab_size)
        out: list[list[float]] = [[] for _ in prompt_ids]
        routes: list | None = [None] * len(prompt_ids) if want_routing else None
        for batch in self._micro_batches([len(p) + len(r) if r else 0
                                          for p, r in zip(prompt_ids, response_ids)]):
            scored, routed = self._score_batch([prompt_ids[j] for j in batch],
                                               [response_ids[j] for j in batch], want_routing)
            for k, (j, lp) in enumerate(zip(batch, scored)):
                out[j] = lp
                if routes is not None:
                    routes[j] = routed[k]  # type: ignore[index]  # lint baseline (issue 39)
        return out, routes

    def _micro_batches(self, lengths: list[int]) -> list[list[int]]:
        """Indices grouped by length so that rows x longest row <= score_batch_tokens (0 = skip)."""
        batches: list[list[int]] = []
        current: list[int] = []
        longest = 0
        for i in sorted(range(len(lengths)), key=lengths.__getitem__):
            if lengths[i] == 0:
                continue
            if current and max(longest, lengths[i]) * (len(current) + 1) > self.score_batch_tokens:
                batches.append(current)
                current, longest = [], 0
            current.append(i)
            longest = max(longest, lengths[i])
        if current:
            batches.append(current)
        return batches

    def _score_batch(self, prompts: list[list[int]], responses: list[list[int]],
                     want_routing: bool = False) -> tuple[list[list[float]], list | None]:
        seqs = [p + r for p, r in zip(prompts, responses)]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, :len(s)] = 1
        with self._capture(want_routing) as cap:
            logits_BLV = self.model(input_ids=ids.to(self.device),
                                    attention_mask=mask.to(self.device)).logits
        routed = None
        if cap is not None:
            routing_BLNK = self._routers.recorded_BLNK(cap, tuple(ids.shape))  # type: ignore[attr-defined]  # lint baseline (issue 39)
            routed = [routing_BLNK[i, :routing_rows(len(p), len(r))].numpy()
                      .astype(self._routers.dtype) for i, (p, r) in enumerate(zip(prompts, responses))]  # type: ignore[attr-defined]  # lint baseline (issue 39)
        out = []
        for i, (p, r) in enumerate(zip(prompts, responses)):
            # Position t predicts token t + 1: response tokens sit at len(p) .. len(p)+len(r)-1.
            rows = logits_BLV[i, len(p) - 1: len(p) + len(r) - 1].float()
            lp = torch.log_softmax(rows, dim=-1)
            target = torch.tensor(r, dtype=torch.long, device=lp.device)
            out.append(lp.gather(-1, target[:, None]).squeeze(-1).tolist())
        return out, routed

    def _capture(self, want_routing: bool):
        """The routers' recording context (hooks made on first use), or a no-op one."""
        if not want_routing:
            return contextlib.nullcontext()
        if self._routers is None:
            from rl.models.routing import RoutingReplay
            self._routers = RoutingReplay(self.model)  # type: ignore[assignment]  # lint baseline (issue 39)
        return self._routers.capture()  # type: ignore[attr-defined]  # lint baseline (issue 39)

    # ---- weights -----------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
                     ) -> None:
        check_version(self.weight_version, version)
        self._targets.load(named_tensors)
        self.weight_version = version

    def _load_received(self, group, plan, version: int, verify: bool) -> int:
        return self._targets.load(receive_stream(group, plan, version, verify, self.dtype))

    @property
    def num_sync_ranks(self) -> int:
        """Ranks this engine takes in the sync group."""
        return 1

    def shutdown(self) -> None:
        self.close_weight_sync()

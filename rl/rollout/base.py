"""The rollout engine interface: what the driver asks of every engine (`vllm`, `hf`, `native`).

Engines are plain Python classes; Ray hosts them as actors, and the same classes run in a plain
process where Ray is absent.

Log-prob convention (what `Sample.logprobs` and `score` return): the log-probability of each
response token under the model's *raw* next-token distribution at temperature 1, i.e.
`log_softmax(logits)[token]` with no temperature, top-p or top-k applied. That is what the trainer
computes, so `exp(logp_trainer - logp_rollout)` (truncated importance sampling) compares the same
distribution on both sides and differs from 1 only by numerics and stale weights. It is *not*
the probability under the (tempered, truncated) distribution the token was drawn from.

Seeds: one `SamplingParams.seed` per call. Prompt i of a call samples from its own stream seeded
with `prompt_seeds(seed, len(prompts))[i]` (engines that draw per request, like vLLM), so two
prompts never share random numbers (vLLM seeds the k-th sample of a request with seed + k: with
consecutive per-prompt seeds, sample 0 of prompt 1 would replay sample 1 of prompt 0).
"""
from __future__ import annotations

import contextlib
import json
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Literal, Protocol, runtime_checkable

import numpy as np
import torch

if TYPE_CHECKING:
    from rl.config import RolloutConfig

FinishReason = Literal["stop", "length"]


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    """0 = greedy (argmax); > 0 samples from softmax(logits / temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 = off."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 = off."""
    max_new_tokens: int = 16
    n: int = 1
    """Samples per prompt (the GRPO group size)."""
    seed: int = 0
    """Seed of this call; per-prompt streams derive from it (see the module docstring)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra tokens that end a response (included in it); the model's EOS ids always stop."""
    return_routing: bool = False
    """Also return each sample's MoE routing (`Sample.routing`, `rl.rollout.routing`)."""

    @classmethod
    def from_rollout(cls, cfg: RolloutConfig, seed: int = 0, return_routing: bool = False
                     ) -> SamplingParams:
        """The rollouts' sampling, as `rollout.` configures it (n = n_samples)."""
        return cls(n=cfg.n_samples, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                   max_new_tokens=cfg.max_new_tokens, seed=seed, return_routing=return_routing)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature: got {self.temperature}, expected >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p: got {self.top_p}, expected a value in (0, 1]")
        if self.top_k != -1 and self.top_k <= 0:
            raise ValueError(f"SamplingParams.top_k: got {self.top_k}, expected -1 (off) or > 0")
        if self.max_new_tokens <= 0 or self.n <= 0:
            raise ValueError(f"SamplingParams: max_new_tokens ({self.max_new_tokens}) and n "
                             f"({self.n}) must be > 0")
        if self.seed < 0:
            raise ValueError(f"SamplingParams.seed: got {self.seed}, expected >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(kw_only=True, slots=True)
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    """Generated tokens, ending with the stop token when finish_reason is `stop`."""
    text: str
    """Decoded response without special tokens ("" when the model directory has no tokenizer)."""
    logprobs: list[float]
    """One per response token: raw temperature-1 log-probs (module docstring)."""
    finish_reason: FinishReason
    weight_version: int
    """The weight version that produced the newest tokens of this sample (all of them unless
    `version_spans` says otherwise)."""
    version_spans: list[tuple[int, int]] = field(default_factory=list)
    """(first response token, weight version) of each span sampled with one version, when the
    generation was interrupted by a weight update and resumed (`algorithm.partial_rollouts:
    resume`); empty = every token came from `weight_version`."""
    routing: np.ndarray | None = None
    """(P + R - 1, layers, top_k) uint8/uint16 expert ids of every input token, when asked for
    (`SamplingParams.return_routing`; format in `rl.rollout.routing`)."""
    # ---- multi-turn episodes (`env.path`, rl/envs/): None for a single-turn sample ----------
    loss_mask: list[int] | None = None
    """Per response token: 1 where the model sampled it, 0 for environment tokens (tool
    results, which the model reads but is not trained on; their `logprobs` are 0)."""
    turns: list[dict] | None = None
    """Per model turn: `start`, `end` (its tokens are response_ids[start:end]), `tool_calls`
    ([name, arguments] pairs parsed from it) and `observation` (the environment's text appended
    after it, or None)."""
    env_reward: float | None = None
    """The environment's reward for the episode (0 when it failed or was cut)."""
    env_error: str | None = None
    """Why the environment failed on this episode (None: it did not)."""
    paused: dict | None = None
    """An episode interrupted by a weight update (`algorithm.partial_rollouts: resume`), to be
    continued with the new weights (`rl.envs.episodes.EpisodeRunner.resume`): `mid_turn` (its
    last model turn is unfinished), `messages` (what the environment got, turn by turn: replayed
    to rebuild it after a restart) and `env_state` (its pickled instance; in memory only, never
    in a checkpoint). None for every sample that is trained on."""

    @property
    def oldest_version(self) -> int:
        """The oldest weight version that sampled any token of this sample."""
        return min(v for _, v in self.version_spans) if self.version_spans else self.weight_version

    def spans(self) -> list[tuple[int, int]]:
        return list(self.version_spans) or [(0, self.weight_version)]


@runtime_checkable
class RolloutEngine(Protocol):
    weight_version: int

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams
                 ) -> list[list[Sample]]:
        """`sampling.n` samples for each prompt, in prompt order; samples in index order."""
        ...

    def score(self, prompt_ids: list[list[int]], response_ids: list[list[int]]
              ) -> list[list[float]]:
        """Raw temperature-1 log-probs of each given response token (proves weights arrived)."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
                     ) -> None:
        """Replace weights in place from (HF name, tensor) pairs; then `weight_version = version`.

        Names are checkpoint names (`rl.models.name_maps.to_engine_weights`); engines that hold
        an HF model also take its in-memory names. Every layer whose weights appear must appear
        whole (vLLM re-processes a layer once all its tensors arrived).
        """
        ...

    def init_weight_sync(self, host: str, port: int, world_size: int, rank: int, backend: str,
                         timeout_s: float) -> None:
        """Join the weight-sync group (`rl.sync.transport.make_group`); blocks until all joined.

        An engine with several workers (tensor parallel) occupies ranks rank .. rank + tp - 1.
        """
        ...

    def receive_weights(self, plan, version: int, verify: bool = False) -> dict:
        """Receive every bucket of `plan` (an `rl.sync.buckets.SyncPlan`), load it, set the version.

        `verify` must match the sender's (`sync.verify`: a sha1 follows every bucket). Returns
        stats: bytes, num_tensors, seconds, gbytes_per_s, loaded_tensors, weight_version.
        """
        ...

    @property
    def num_sync_ranks(self) -> int:
        """Ranks this engine takes in the sync group (its tensor-parallel size)."""
        ...

    def shutdown(self) -> None:
        ...


# --------------------------------------------------------------------------------------
# Helpers shared by the engines
# --------------------------------------------------------------------------------------
def prompt_seeds(seed: int, num_prompts: int) -> list[int]:
    """Independent 62-bit seeds, one per prompt: a pure function of (seed, prompt index)."""
    words = np.random.SeedSequence(seed).generate_state(max(num_prompts, 1) * 2, dtype=np.uint32)
    pairs = words.reshape(-1, 2).astype(np.uint64)
    return [int(((hi << np.uint64(32)) | lo) >> np.uint64(2)) for hi, lo in pairs[:num_prompts]]


def read_eos_ids(model_dir: str | Path) -> list[int]:
    """EOS token ids from generation_config.json, else config.json (int or list); may be empty."""
    model_dir = Path(model_dir)
    for fname in ("generation_config.json", "config.json"):
        path = model_dir / fname
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return sorted({int(e) for e in (eos if isinstance(eos, list) else [eos])})
    return []


def has_tokenizer(model_dir: str | Path) -> bool:
    model_dir = Path(model_dir)
    return any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model",
                                                   "vocab.json", "tokenizer_config.json"))


def check_token_lists(name: str, lists: list[list[int]], vocab_size: int,
                      allow_empty: bool = False) -> None:
    """Fail with the list index and the offending id instead of a device-side assert."""
    if not isinstance(lists, (list, tuple)):
        raise TypeError(f"{name}: expected a list of token-id lists, got {type(lists).__name__}")
    for i, ids in enumerate(lists):
        if not ids and not allow_empty:
            raise ValueError(f"{name}[{i}] is empty")
        for t in ids:
            if not 0 <= int(t) < vocab_size:
                raise ValueError(f"{name}[{i}] holds token id {t}, outside [0, {vocab_size})")


def check_score_args(prompt_ids: list[list[int]], response_ids: list[list[int]],
                     vocab_size: int) -> None:
    """The shared argument checks of every engine's `score`."""
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"score: {len(prompt_ids)} prompts but {len(response_ids)} responses")
    check_token_lists("prompt_ids", prompt_ids, vocab_size)
    check_token_lists("response_ids", response_ids, vocab_size, allow_empty=True)


KEPT_MARKERS = ("<think>", "</think>")
"""Reasoning markers every response text keeps, even from a tokenizer that marks them special
(a `skip_special_tokens` decode drops those): `reward.answer_after` splits responses at
`</think>`. DeepSeek's and Qwen3's tokenizers mark neither special; this guards the others."""

_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def special_markers(tokenizer) -> dict[int, str]:
    """{token id: marker} for each of KEPT_MARKERS that `tokenizer` holds as one token and drops
    when decoding with `skip_special_tokens` (empty for DeepSeek's tokenizers). Probed by
    decoding the markers (~0.3 ms), once per tokenizer object."""
    try:
        return _PROBED[tokenizer]
    except (KeyError, TypeError):  # TypeError: no weak references to it, so probed every time
        pass
    found = {}
    for marker in KEPT_MARKERS:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1 and marker not in tokenizer.decode(ids, skip_special_tokens=True):
            found[ids[0]] = marker
    with contextlib.suppress(TypeError):
        _PROBED[tokenizer] = found
    return found


def decode_response(tokenizer, tokens: list[int], reason: str) -> str:
    """Text without special tokens and without the stop token (as vLLM returns it), but with
    KEPT_MARKERS, which are spliced back where the tokenizer would drop them."""
    if tokenizer is None:
        return ""
    tokens = tokens[:-1] if reason == "stop" else tokens
    kept = special_markers(tokenizer)
    if kept.keys().isdisjoint(tokens):
        return tokenizer.decode(tokens, skip_special_tokens=True)
    parts, start = [], 0
    for i, t in enumerate(tokens):
        if t in kept:
            parts += [tokenizer.decode(tokens[start:i], skip_special_tokens=True), kept[t]]
            start = i + 1
    parts.append(tokenizer.decode(tokens[start:], skip_special_tokens=True))
    return "".join(parts)


def check_version(current: int, new: int) -> None:
    """Weight versions never go backwards (re-sending the current version is allowed)."""
    if new < current:
        raise ValueError(f"weight version must not go backwards: engine holds {current}, got {new}")


def cut_at_stop(tokens: list[int], stop_ids: set[int]) -> tuple[list[int], FinishReason]:
    """Tokens up to and including the first stop token, and why the response ended."""
    for j, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: j + 1], "stop"
    return tokens, "length"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto`: fp32 on CPU (agrees with the fp32 CPU trainer; bf16 is slow there), else bf16."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; expected auto, float32, bfloat16 or float16")
    return value

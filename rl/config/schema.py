"""The config schema: one typed dataclass per component, each field with its docstring, and the
checks in `__post_init__` that raise `FieldError` (the loader, `rl.config.loader`, turns it into a
`ConfigError` naming `file:key`).

Each component receives only its own dataclass (`cfg.trainer`, `cfg.rollout`, ...).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A user-facing configuration problem; the message is one line naming file:key."""


class FieldError(ValueError):
    """Raised by `__post_init__` validation; the loader turns it into a `ConfigError`."""

    def __init__(self, key: str, value: Any, expected: str):
        super().__init__(f"{key}: got {value!r}, expected {expected}")
        self.key, self.value, self.expected = key, value, expected


def _check(ok: bool, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise FieldError(key, value, expected)


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _check(value > 0, name, value, "a value > 0")


def _non_negative(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _check(value >= 0, name, value, "a value >= 0")


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def _open_unit(obj: Any, *names: str) -> None:
    """Fractions that are meaningless at both ends (clip ranges)."""
    for name in names:
        value = getattr(obj, name)
        _check(0 < value < 1, name, value, "a value in (0, 1)")


# --------------------------------------------------------------------------------------
# Components
# --------------------------------------------------------------------------------------
MODEL_PRESETS = ("tiny-qwen3-moe", "tiny-deepseek-v4", "tiny-deepseek-v3")
THINK_END = "</think>"
"""Where DeepSeek-V4's reasoning block ends (`rl.data.deepseek_v4.THINK_END`; rl.data imports
this module, so the string is repeated here)."""


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    preset: str | None = "tiny-qwen3-moe"
    """Name of a tiny offline preset (built deterministically); ignored when `path` is set."""
    path: str | None = None
    """A local Hugging Face checkpoint directory (config.json + safetensors + tokenizer)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Trainer parameter dtype. CPU trains in fp32 (bf16 is slow without AVX-512); GPUs use bf16."""
    seed: int = 0
    """Seed for building a preset's random initial weights (>= 0)."""
    warm_start: bool = True
    """Start RL from the SFT warm-started checkpoint (built and cached by `launch.sft`)."""

    def __post_init__(self) -> None:
        _non_negative(self, "seed")
        if self.path is None:
            _check(self.preset in MODEL_PRESETS, "preset", self.preset,
                   f"one of {', '.join(MODEL_PRESETS)} (or set model.path)")


@dataclass(kw_only=True, slots=True)
class SyntheticConfig:
    num_train: int = 4000
    """Distinct training prompts (`a+b=` problems); num_train + num_eval may not exceed the number
    of distinct problems the settings allow."""
    num_eval: int = 200
    """Distinct held-out prompts, disjoint from the training ones."""
    min_value: int = 0
    """Smallest operand value (see max_value)."""
    max_value: int = 99
    """Operands are drawn uniformly from [min_value, max_value]."""
    num_operands: int = 2
    """Operands per problem (>= 1): 2 gives `a+b=`, 3 gives `a+b-c=`."""
    operators: list[str] = field(default_factory=lambda: ["+", "-"])
    """Operators between operands, drawn uniformly from the distinct entries: `+`, `-`, `*`."""

    def __post_init__(self) -> None:
        _positive(self, "num_train", "num_eval", "num_operands")
        _check(self.max_value >= self.min_value, "max_value", self.max_value,
               f"a value >= min_value ({self.min_value})")
        for op in self.operators:
            _check(op in ("+", "-", "*"), "operators", self.operators, "a list of '+', '-', '*'")
        _check(len(self.operators) > 0, "operators", self.operators, "a non-empty list")


@dataclass(kw_only=True, slots=True)
class DeepSeekV4PromptConfig:
    thinking: bool = True
    """Open the reply inside a `<think>` block (DeepSeek's thinking mode, its default and the
    one for multi-step math); false = chat mode, "Non-think" (the prompt ends in `</think>`)."""
    reasoning_effort: Literal["high", "max"] = "high"
    """`high` ("Think High"): DeepSeek's default prompt; `max` ("Think Max"): DeepSeek's prefix
    asking for exhaustive reasoning, far longer responses (thinking mode only)."""

    def __post_init__(self) -> None:
        _check(self.thinking or self.reasoning_effort == "high", "reasoning_effort",
               self.reasoning_effort, "'high' when thinking is false (DeepSeek's encoding adds "
               "the max-effort prefix only in thinking mode)")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    source: Literal["synthetic", "file"] = "synthetic"
    """`synthetic`: generated arithmetic (`data.synthetic`); `file`: JSONL or Parquet rows from
    `train_path` (and `eval_path`)."""
    train_path: str | None = None
    """JSONL or Parquet file of training prompts (source: file)."""
    eval_path: str | None = None
    """JSONL or Parquet file of held-out prompts (source: file); unset = split `eval_fraction`
    off `train_path`."""
    eval_fraction: float = 0.05
    """source: file without `eval_path`: the share of `train_path`'s distinct prompts held out as
    the eval set, in [0, 1) (at least one prompt; every copy of a prompt lands on the same side,
    so the splits are disjoint). The split is a pure function of the top-level `seed`. 0 = no
    held-out set: evaluation is off. Ignored when `eval_path` is set or source is synthetic."""
    prompt_key: str = "question"
    """source: file: the row field that holds the prompt text."""
    answer_key: str = "answer"
    """source: file: the row field that holds the reference answer (read by `answer_format`)."""
    answer_format: Literal["auto", "gsm8k", "boxed", "raw"] = "auto"
    """How to extract the reference answer: `#### 42` (gsm8k), `\\boxed{..}`, the raw field, or auto."""
    prompt_format: Literal["auto", "raw", "chat_template", "deepseek_v4"] = "auto"
    """How a prompt becomes the policy's input (docs/prompt_format.md): `raw` (the text as is),
    `chat_template` (the tokenizer's chat template, one user turn, generation prompt appended),
    `deepseek_v4` (DeepSeek-V4's published encoding, which is code, not a template: its
    published tokenizer has no chat template), or `auto`: `chat_template` when
    `chat_template` is true, else `raw`."""
    chat_template: bool = False
    """The older spelling of `prompt_format: chat_template` (with prompt_format auto); true with
    another prompt_format is an error."""
    system_prompt: str | None = None
    """System message before every prompt (prompt_format chat_template or deepseek_v4); null =
    none."""
    deepseek_v4: DeepSeekV4PromptConfig = field(default_factory=DeepSeekV4PromptConfig)
    """Options of `prompt_format: deepseek_v4` (an error to change them with another format)."""
    max_prompt_tokens: int = 256
    """Prompt tokens (with the run's tokenizer, after the prompt format) a row may hold; the
    submit-time data check refuses longer prompts (the job would keep only their end)."""
    shuffle: bool = True
    """Draw training prompts in a fresh seeded order every epoch; false = the data's order."""
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    """The generated arithmetic task (source: synthetic)."""

    def __post_init__(self) -> None:
        _positive(self, "max_prompt_tokens")
        _check(0 <= self.eval_fraction < 1, "eval_fraction", self.eval_fraction,
               "a value in [0, 1)")
        fmt = self.format
        _check(not self.chat_template or self.prompt_format in ("auto", "chat_template"),
               "chat_template", self.chat_template, f"false with prompt_format "
               f"{self.prompt_format!r} (chat_template: true is the older spelling of "
               "prompt_format: chat_template)")
        _check(self.system_prompt is None or fmt != "raw", "system_prompt", self.system_prompt,
               "null with raw prompts (a system message needs prompt_format chat_template or "
               "deepseek_v4)")
        _check(fmt == "deepseek_v4" or self.deepseek_v4 == DeepSeekV4PromptConfig(),
               "deepseek_v4", to_dict(self.deepseek_v4), f"its defaults with prompt_format "
               f"{fmt!r} (these options are read by deepseek_v4 only)")
        if self.source == "file":
            _check(self.train_path is not None, "train_path", self.train_path,
                   "a JSONL or Parquet path when source is 'file'")

    @property
    def format(self) -> str:
        """The prompt format in effect: `prompt_format` with `auto` resolved, so one of `raw`,
        `chat_template`, `deepseek_v4`."""
        if self.prompt_format != "auto":
            return self.prompt_format
        return "chat_template" if self.chat_template else "raw"


@dataclass(kw_only=True, slots=True)
class RewardSandboxConfig:
    """Limits of a sandboxed correctness call (`reward.sandbox.enabled`; docs/rewards.md)."""
    enabled: bool = False
    """Run each correctness call in a process of its own, forked from its reward worker, with
    the limits below, in an empty temporary directory, and (Landlock) unable to write anywhere
    else or to read the run directory and the data files. For rewards that execute model
    output; costs a fork per sample."""
    cpu_s: int = 10
    """CPU seconds of the call's process (RLIMIT_CPU; each process it starts has its own)."""
    memory_mb: int = 1024
    """Address space the call may add to what its worker already maps (RLIMIT_AS) [MiB]."""
    open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""
    file_mb: int = 16
    """Largest file the call may write (RLIMIT_FSIZE) [MiB]."""
    processes: int = 32
    """Processes the call may add to the user's count (RLIMIT_NPROC; not enforced for root,
    where only the kill of the call's process group and its orphans at the end bounds them)."""
    require_landlock: bool = True
    """Refuse to start without Landlock (Linux >= 5.13 with the LSM enabled); false runs with
    the resource limits and the empty directory only, which does not stop the call from
    reading or writing the user's files."""

    def __post_init__(self) -> None:
        _positive(self, "cpu_s", "memory_mb", "open_files", "file_mb", "processes")


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    function: str = "math"
    """`math` (math-verify equivalence), `exact`, or a user function `package.module:function`."""
    format_weight: float = 0.0
    """Weight of the format reward (answer present in the expected form) added to correctness."""
    response_format: Literal["auto", "number", "boxed", "gsm8k"] = "auto"
    """Form the format reward expects: the whole response a bare number (`number`, the synthetic
    task), a final `\\boxed{..}`, a final `#### answer` line, or any of these (`auto`)."""
    verify_timeout_s: float = 5.0
    """Time limit for one call of the correctness function, built-in or plugin (seconds, 0 =
    off): past it the call is killed (its worker, replaced; with the sandbox, its process), the
    sample scores 0 and counts in `reward/failures`. Not enforced with num_workers 0."""
    num_workers: int | Literal["auto"] = "auto"
    """Worker processes the correctness function runs in; a batch is split over them, the
    rewards are the same for any count. `auto`: half the CPUs this process may use, 1 to 8.
    0 = in the driver (no isolation, no time limit: for stepping through a plugin in a
    debugger)."""
    sandbox: RewardSandboxConfig = field(default_factory=RewardSandboxConfig)
    """Resource limits and filesystem isolation per call, for rewards that run model output."""
    answer_after: str | None = "auto"
    """Score only the text after the last occurrence of this marker (stripped): the correctness
    function and the format reward see that tail, the trajectory log keeps the whole response.
    A response without the marker (its reasoning never closed) scores 0, is not a failure, and
    counts in `reward/unclosed_thinking_frac`. null = score the whole response. `auto` (resolved
    when the config loads): `</think>` with `data.prompt_format: deepseek_v4` and
    `data.deepseek_v4.thinking` (the reply opens inside a `<think>` block), else null."""

    def __post_init__(self) -> None:
        builtin = self.function in ("math", "exact")
        _check(builtin or ":" in self.function, "function", self.function,
               "'math', 'exact' or a dotted path 'package.module:function'")
        _non_negative(self, "format_weight", "verify_timeout_s")
        _check(self.num_workers == "auto" or self.num_workers >= 0, "num_workers",
               self.num_workers, "'auto' or a count >= 0")
        _check(not self.sandbox.enabled or self.num_workers != 0, "sandbox.enabled", True,
               "false with num_workers 0 (the sandbox forks from a reward worker)")
        marker = self.answer_after
        _check(marker is None or marker.strip() != "", "answer_after", marker,
               "'auto', null or a non-blank marker such as '</think>'")
        _check(marker is None or marker.lower() != "none", "answer_after", marker,
               "null to score the whole response ('none' would be a literal marker)")


@dataclass(kw_only=True, slots=True)
class EnvConfig:
    path: str | None = None
    """A multi-turn, tool-using environment `package.module:Class` (docs/environments.md); its
    reward replaces `reward.function` for training and evaluation. null = single-turn rollouts
    scored by the reward function."""
    max_turns: int = 4
    """Model turns per episode (>= 1); an episode still asking for tools after the last one is
    cut (reward 0, finish reason `length`)."""
    max_response_tokens: int = 64
    """Response budget of an episode, model and environment tokens together (each model turn
    is also capped at rollout.max_new_tokens); <= rollout.max_model_len - 1."""
    step_timeout_s: float = 10.0
    """Time limit of one environment call (its `__init__` and `step`), seconds, > 0: past it
    the worker is killed and replaced and the episode fails (reward 0, `env/failures`)."""
    num_workers: int | Literal["auto"] = "auto"
    """Environment worker processes; `auto`: half the CPUs this process may use, 1 to 8."""
    tool_format: Literal["auto", "raw", "deepseek_v4"] = "auto"
    """How tool calls are written and tool results shown (rl/envs/tools.py): `raw`
    (`[NAME: ARGS]`, results `[result: TEXT]`), `deepseek_v4` (DeepSeek-V4's DSML tool calls and
    `<tool_result>` blocks); `auto` follows data.prompt_format."""

    def __post_init__(self) -> None:
        _check(self.path is None or ":" in self.path, "path", self.path,
               "null or a dotted path 'package.module:Class'")
        _positive(self, "max_turns", "max_response_tokens", "step_timeout_s")
        _check(self.num_workers == "auto" or (isinstance(self.num_workers, int)
                                              and self.num_workers >= 1),
               "num_workers", self.num_workers, "'auto' or a count >= 1")


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    engine: Literal["vllm", "hf", "native"] = "vllm"
    """`vllm` (vLLM, weights reloaded in place), `hf` (transformers `generate`, the reference) or
    `native` (our GPU engine: static KV cache, CUDA graphs, FP8 weights)."""
    num_engines: int = 1
    """Rollout engine actors; a step's prompts are split evenly over them (engine i samples with
    seed + i)."""
    tensor_parallel_size: int = 1
    """GPUs per engine (vLLM tensor parallel); every one of its workers receives the weight
    updates."""
    quantization: Literal["none", "fp8"] = "none"
    """`fp8` on GPU clusters (vLLM's FP8 path has no CPU kernel)."""
    model_path: str | None = None
    """vllm: the checkpoint the engine is built from and first loads (null: the trainer's
    model). DeepSeek-V4 on GPUs: the `python -m launch.convert SRC --rollout-out DIR` directory,
    so vLLM builds its own V4 FP8 layout (block-FP8 linears and experts, from that
    config.json's quantization_config and `expert_dtype: fp8`, the layout the weight sync
    sends) rather than quantising BF16 weights online."""
    kv_cache_dtype: Literal["auto", "bfloat16", "fp8", "fp8_ds_mla"] = "auto"
    """The engine's KV cache: `auto` (the engine's dtype: bf16 on GPUs, fp32 on CPU), `bfloat16`,
    `fp8` (e4m3 with scales: vllm, and native, whose cache then holds 1.98x the sequences in the
    same bytes: one scale byte per token and KV head, rl/rollout/native/kvcache.py) or
    `fp8_ds_mla` (DeepSeek-V4's packed FP8 layout, 584 B per entry, which vLLM's V4 requires on
    GPUs: it turns auto and fp8 into it). The same key sizes the KV cache in the memory plan
    (`launch.plan`, see rl/plan/kv.py)."""
    n_samples: int = 8
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (>= 0; 0 = greedy)."""
    top_p: float = 1.0
    """Nucleus sampling: sample from the smallest set of tokens holding this much probability;
    in (0, 1], 1 = off."""
    top_k: int = -1
    """Sample among the k most likely tokens only; -1 = off."""
    max_new_tokens: int = 16
    """Response budget per sample; <= max_model_len (the context holds the prompt too)."""
    gpu_memory_utilization: float = 0.85
    """vLLM on GPU: the share of the GPU's memory the engine takes (weights, activations, and the
    rest as KV cache), in (0, 1]; the planner reads it too."""
    max_model_len: int = 512
    """The engine's context length (prompt + response)."""
    enforce_eager: bool = True
    """vLLM: run the model eagerly (no CUDA graphs or torch.compile): faster start, slower
    decode."""
    use_aiter: bool = False
    """ROCm only: turn on vLLM's AITER kernels (VLLM_ROCM_USE_AITER and friends)."""
    cpu_kvcache_gb: float = 1.0
    """vLLM on CPU: KV-cache size [GiB]; the VLLM_CPU_KVCACHE_SPACE variable overrides it, with a
    warning."""
    torch_threads: int | None = None
    """torch threads (and OMP_NUM_THREADS) of each engine process; null = trainer.torch_threads.
    On a CPU machine where the trainer ranks wait while the engine generates (on-policy), the
    engine may take the cores they leave idle."""
    seed: int = 1234
    """Seed of the rollout sampling (>= 0): each step's sampling seed is a pure function of it
    and the step (`rl.pipeline.rollout_seed`); vLLM's engine seed too."""
    max_batch_size: int = 256
    """`native`: sequences decoded together; the static KV cache holds this many x max_model_len
    (allocated as needed, in power-of-two batch buckets). Larger requests run in chunks."""
    cuda_graphs: bool = True
    """`native`: replay each decode step from a CUDA graph (one per batch bucket); off = eager."""
    decode_attention: Literal["auto", "single", "split"] = "single"
    """`native` on GPU, the decode attention kernel: `single` (one program per row and KV head
    walks the whole context; the kernel bench/results/rollout.md measured), `split` (split-K,
    "flash-decoding": each row and KV head's context split over several programs, their
    partials combined by a second kernel) or `auto` (split where `decode_splits` in
    rl/rollout/native/kernels.py gives more than one split for the batch bucket and
    max_model_len, i.e. where rows x KV heads alone do not fill the GPU)."""
    fp8_keep_bf16: list[str] | None = None
    """`native` with quantization fp8: name patterns of linear weights kept in BF16 (glob, or
    're:REGEX'); null = rl.quant.DEFAULT_KEEP_BF16. Embeddings, LM head, router, norms are
    always BF16 in the native engine."""
    fp8_pow2_scales: bool = False
    """`native` with quantization fp8: round block scales up to powers of two."""

    def __post_init__(self) -> None:
        kv_ok = ["auto", "bfloat16", *{"vllm": ["fp8", "fp8_ds_mla"],
                                         "native": ["fp8"]}.get(self.engine, [])]
        _check(self.kv_cache_dtype in kv_ok, "kv_cache_dtype", self.kv_cache_dtype,
               f"{', '.join(map(repr, kv_ok[:-1]))} or {kv_ok[-1]!r} with engine {self.engine!r}")
        _check(self.model_path is None or self.engine == "vllm", "model_path", self.model_path,
               f"null with engine {self.engine!r} (only the vllm engine is built from its own "
               "checkpoint)")
        _positive(self, "num_engines", "tensor_parallel_size", "n_samples", "max_new_tokens",
                  "max_model_len", "cpu_kvcache_gb", "max_batch_size")
        _check(self.torch_threads is None or (isinstance(self.torch_threads, int)
                                              and self.torch_threads > 0),
               "torch_threads", self.torch_threads, "null or an integer > 0")
        if self.fp8_keep_bf16 is not None:
            _check(all(isinstance(p, str) and p and p != "re:" for p in self.fp8_keep_bf16),
                   "fp8_keep_bf16", self.fp8_keep_bf16, "null or a list of non-empty patterns")
        _check(self.temperature >= 0, "temperature", self.temperature, "a value >= 0")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "a value in (0, 1]")
        _check(self.top_k == -1 or self.top_k > 0, "top_k", self.top_k, "-1 (off) or > 0")
        _check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
               self.gpu_memory_utilization, "a value in (0, 1]")
        _non_negative(self, "seed")
        _check(self.max_new_tokens <= self.max_model_len, "max_new_tokens", self.max_new_tokens,
               f"a value <= max_model_len ({self.max_model_len})")


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    num_ranks: int = 2
    """DeepSpeed trainer ranks (processes; one GPU each on a GPU machine)."""
    zero_stage: int = 3
    """DeepSpeed ZeRO stage: 0 = none, 1 partitions optimizer state, 2 also gradients, 3 also
    parameters."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto`: CUDA when a GPU is visible, else CPU; `cuda` fails without a GPU; `cpu` forces
    CPU."""
    lr: float = 1e-5
    """Peak AdamW learning rate (> 0)."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay (>= 0)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW's (beta1, beta2), each in [0, 1)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from lr / warmup_steps up to lr; 0 = none."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warmup: `constant`, or `cosine` decay to min_lr_ratio x lr at the last optimizer step
    of the run."""
    min_lr_ratio: float = 0.1
    """`cosine`: the final learning rate as a fraction of lr, in [0, 1]."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (DeepSpeed `gradient_clipping`); 0 = off."""
    micro_batch_tokens: int = 4096
    """Token budget of one micro-batch (prompt + response tokens, padded; with pack_sequences
    the real tokens)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch, each of num_mini_batches optimizer steps."""
    num_mini_batches: int = 1
    """Optimizer steps per PPO epoch; the rollout batch is split evenly."""
    torch_threads: int = 1
    """torch threads of each trainer rank (`torch.set_num_threads`); also OMP_NUM_THREADS of every
    trainer and engine process."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward (transformers' gradient checkpointing)."""
    optimizer_offload: Literal["none", "cpu", "nvme"] = "none"
    """DeepSpeed `offload_optimizer` device: fp32 master weights, Adam moments and gradient
    partitions in host RAM (`cpu`) or on local NVMe (`nvme`, ZeRO-Infinity). Needs
    zero_stage >= 1. With expert_parallel_size > 1, cpu or nvme also moves the expert shards'
    fp32 master weights and AdamW moments to host RAM (not NVMe), stepped on the CPU by torch's
    fused AdamW."""
    param_offload: Literal["none", "cpu"] = "none"
    """DeepSpeed `offload_param` (ZeRO-3 only): the bf16 parameter partition lives in host RAM."""
    attention_kernel: Literal["auto", "eager", "fused"] = "auto"
    """The trainer's attention, by the rule `load_model` applies (`rl.models.attention`); the
    memory planner's activation estimate reads the same key. `auto` / `fused`: O(S) memory (SDPA;
    for deepseek_v4 our `rl.models.v4_attention`, same outputs as transformers' eager). `eager`:
    transformers' eager deepseek_v4 attention, whose (heads x S x S) scores are counted."""
    nvme_path: str = "/local_nvme/deepspeed"
    """Where ZeRO-Infinity puts optimizer state with `optimizer_offload: nvme` (node-local disk)."""
    chunked_lm_head: bool = True
    """Compute the log-probs (and the entropy) straight from the final hidden states and the LM
    head's weight, `lm_head_chunk_rows` rows of logits at a time (`rl.trainer.lm_head`: same
    values and gradients), instead of materialising the (tokens x vocabulary) logits, their
    gradient and fp32 copies (8 B per token and vocabulary entry: 17.8 GiB per GPU for
    DeepSeek-V4-Flash at 18,432 tokens). `false`: the full-logits path. Needs an `nn.Linear`
    head without bias (every supported model)."""
    pack_sequences: bool = False
    """Pack each micro-batch's rows end to end into one sequence (per-row positions, attention
    within each row: FlashAttention varlen on a GPU, `rl.models.varlen`; `rl.trainer.packing`)
    instead of padding them to the longest: the same log-probs without computing padding, and
    `micro_batch_tokens` then counts real tokens. Not with routing replay, sliding-window models,
    or DeepSeek-V4 with `attention_kernel: eager`."""
    lm_head_chunk_rows: int = 1024
    """Rows (tokens) of logits the chunked LM head holds at once, forward and backward (its
    backward holds as many logits, a slice of the vocabulary for every token): about 8 B x rows
    x vocabulary of working memory (1 GiB at 1,024 rows of V4's 129,280)."""
    expert_parallel_size: int = 1
    """Ranks that split each MoE layer's routed experts (`rl.trainer.expert_parallel`): each
    holds 1/EP of them and tokens are exchanged all-to-all; must divide num_ranks and the
    model's expert count, needs zero_stage 2 or 3. 1 = off (ZeRO handles experts like any
    weight)."""

    def __post_init__(self) -> None:
        _positive(self, "num_ranks", "lr", "micro_batch_tokens", "ppo_epochs", "num_mini_batches",
                  "torch_threads", "lm_head_chunk_rows")
        _non_negative(self, "weight_decay", "warmup_steps", "grad_clip")
        _check(self.zero_stage in (0, 1, 2, 3), "zero_stage", self.zero_stage, "0, 1, 2 or 3")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas", self.betas,
               "two values in [0, 1)")
        _check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", self.min_lr_ratio, "a value in [0, 1]")
        ep = self.expert_parallel_size
        _check(ep >= 1 and self.num_ranks % ep == 0, "expert_parallel_size", ep,
               f"a divisor of num_ranks ({self.num_ranks})")
        _check(ep == 1 or self.zero_stage in (2, 3), "expert_parallel_size", ep,
               f"1 with zero_stage {self.zero_stage} (expert parallelism runs under ZeRO-2 and "
               "ZeRO-3)")


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    prompts_per_step: int = 16
    """Prompts sampled per step; a step's batch is prompts_per_step x rollout.n_samples
    responses."""
    normalize_std: bool = True
    """GRPO: divide group-centred rewards by the group std."""
    clip_low: float = 0.2
    """PPO clip: the lower ratio bound is 1 - clip_low, in (0, 1)."""
    clip_high: float = 0.28
    """Clip-higher: the upper ratio bound is 1 + clip_high, in (0, 1)."""
    loss_agg: Literal["token", "sequence"] = "token"
    """`token`: the loss is the mean over every valid token of the mini-batch (long answers weigh
    more); `sequence`: the mean within each sequence, then over sequences."""
    kl_coef: float = 0.0
    """Weight of the KL(policy || reference) penalty; the reference is the frozen starting
    model. 0 = off (no reference model is loaded)."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """Per-token KL estimate, with r = ref_logp - logp: `k1` = -r; `k3` = exp(r) - r - 1
    (>= 0, lower variance)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus subtracted from the loss; 0 = off (entropy is then not
    computed)."""
    tis_cap: float | None = 2.0
    """Truncated importance sampling cap on exp(logp_trainer_old - logp_rollout); null = off."""
    max_staleness: int = 0
    """0 = on-policy (rollout, then train). k >= 1: the rollout group generates the batches of the
    next k steps while the trainer trains on the current one (one-step-off-policy at 1); a sample
    is at most k weight versions older than the policy that trains on it."""
    partial_rollouts: Literal["finish", "resume"] = "finish"
    """With max_staleness >= 1, what happens to generations still running when the weights are
    updated: `finish` them with the old weights (the update waits), or interrupt them after
    `partial_tokens` tokens and `resume` them with the new weights (per-token-span versions are
    logged). The interrupt point is a token budget, not a wall-clock moment, so runs stay
    deterministic and resume exactly."""
    partial_tokens: int | None = None
    """Tokens generated with the old weights before a `resume` interrupt (of a multi-turn
    episode: response tokens, model and environment ones); null = half of
    rollout.max_new_tokens (env.max_response_tokens with env.path)."""
    routing_replay: Literal["off", "r2", "r3", False] = "off"
    """MoE routing replay in the trainer. `r3`: the engines return the experts they chose for
    every token and the trainer's old- and new-policy passes use them (gate weights recomputed
    from the trainer's router logits, so the router still learns); `r2`: the update passes
    replay the trainer's own routing from its old-policy pass. `off` (YAML's bare off = false)."""
    stale_samples: Literal["drop", "keep"] = "drop"
    """Samples older than max_staleness (e.g. after lowering it on resume): `drop` them from the
    batch (counted in rollout/dropped_samples) or `keep` them (TIS against the stored behaviour
    log-probs re-weights them)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop the prompt groups whose rewards are all equal (zero advantage)
    and refill the batch with more prompts, generated with the current weights, for at most
    `max_gen_rounds` generation rounds per step; a batch still short then is filled with dropped
    groups (counted in sampling/padded_groups). Needs rollout.n_samples >= 2."""
    max_gen_rounds: int = 4
    """With dynamic_sampling: generation rounds per step at most, the first included (>= 2). Each
    refill round draws as many prompts as the batch still lacks."""
    overlong_buffer: int = 0
    """DAPO's soft overlong penalty: a response longer than rollout.max_new_tokens -
    overlong_buffer tokens loses overlong_penalty_factor x (excess / overlong_buffer) reward,
    linearly up to the whole factor at max_new_tokens (0 = off; at most rollout.max_new_tokens).
    Training rewards only, not evaluation."""
    overlong_penalty_factor: float = 1.0
    """The overlong penalty at rollout.max_new_tokens [reward units] (> 0)."""

    def __post_init__(self) -> None:
        _positive(self, "prompts_per_step", "overlong_penalty_factor")
        _open_unit(self, "clip_low", "clip_high")
        _non_negative(self, "kl_coef", "entropy_coef", "max_staleness", "overlong_buffer")
        _check(self.max_gen_rounds >= 2, "max_gen_rounds", self.max_gen_rounds,
               "a value >= 2 (the first round and at least one refill round)")
        if self.partial_tokens is not None:
            _positive(self, "partial_tokens")
        if self.tis_cap is not None:
            _check(self.tis_cap >= 1, "tis_cap", self.tis_cap, "null (off) or a value >= 1")
        if self.routing_replay is False:
            self.routing_replay = "off"


@dataclass(kw_only=True, slots=True)
class SyncConfig:
    bucket_mb: float = 64.0
    """Weight-sync bucket size [MiB]: tensors are packed into buckets that are broadcast one after
    another (a larger tensor gets a bucket of its own)."""
    backend: Literal["auto", "gloo", "nccl", "ipc"] = "auto"
    """Weight-sync transport: `gloo`, `nccl`, `ipc` (shared memory: CUDA IPC handles on a GPU,
    /dev/shm on a CPU; trainer rank 0 and the engines on one device of one host), or `auto` = ipc
    when the engines share trainer rank 0's GPU, nccl when they have GPUs of their own, else gloo
    (`rl.sync.backend`; a choice that cannot work is refused before the run starts)."""
    wire_dtype: Literal["native", "fp8"] = "native"
    """`fp8`: quantise on send (block FP8 + scales on the wire, ~half of BF16's bytes); `native`:
    the trainer dtype on the wire, and an FP8 rollout engine (`native` with quantization fp8)
    quantises on receive."""
    wire_keep_bf16: list[str] | None = None
    """With wire_dtype fp8: parameter-name patterns sent unquantised (glob or 're:REGEX');
    null = rl.quant.DEFAULT_KEEP_BF16 (embeddings, LM head, routers, norms)."""
    verify: bool = False
    """Checksum every bucket and fail loudly on mismatch."""
    timeout_s: float = 300.0
    """Limit [s] on the weight-sync rendezvous and on each bucket's transfer; the driver allows a
    whole update this plus 60 s. Past it: SyncError."""
    check_logprobs: bool = False
    """After every sync, score a fixed probe sequence on the trainer and every engine and fail if
    they differ by more than `check_logprobs_tol` (logged as `sync/logprob_max_diff`)."""
    check_logprobs_tol: float = 1e-3
    """Largest |trainer - engine| log-prob allowed on the probe sequence (> 0)."""

    def __post_init__(self) -> None:
        _positive(self, "bucket_mb", "timeout_s", "check_logprobs_tol")


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    every: int = 5
    """Evaluate every N steps (0 = only before and after the run)."""
    num_prompts: int = 200
    """Eval prompts used: the first N of the eval set."""
    pass_k: int = 4
    """Samples per eval prompt for `eval/pass_k`; 1 = greedy pass@1 only."""
    pass_k_temperature: float = 1.0
    """Sampling temperature of the pass@k samples (>= 0)."""
    at_start: bool = True
    """Evaluate the starting (warm-start) model before the first step (logged at step 0)."""

    def __post_init__(self) -> None:
        _non_negative(self, "every", "pass_k_temperature")
        _positive(self, "num_prompts", "pass_k")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    every: int = 5
    """Write a checkpoint every N steps; one is also written on a stop and at the end of the run
    (0 = only then)."""
    keep_last: int = 2
    """How many of the newest complete checkpoints retention keeps (> 0); older ones are deleted
    after each save unless keep_every keeps them."""
    keep_every: int = 0
    """Also keep every N-th step's checkpoint forever (0 = off)."""
    grace_period_s: float = 60.0
    """After a stop signal, the time allowed to finish the step and write the checkpoint."""
    max_bad_steps: int = 3
    """Abort (with a checkpoint) after this many non-finite steps in a row."""
    checksums: bool = True
    """Record each checkpoint file's SHA-256 in the manifest (hashed by the process that wrote
    it, right after writing) and verify them before a resume, which then falls back past a
    damaged checkpoint. Costs one extra read of the checkpoint on save and on resume, spread
    over the trainer ranks. Off: only file sizes are recorded and checked."""
    export_final: bool = False
    """At the end of a run that completed, export the last checkpoint's actor as a Hugging Face
    model directory (BF16 safetensors, config, tokenizer) into RUN_DIR/export/hf, as
    `python -m launch.export RUN_DIR --format hf` does (docs/export.md)."""

    def __post_init__(self) -> None:
        _non_negative(self, "every", "keep_every")
        _positive(self, "keep_last", "grace_period_s", "max_bad_steps")


@dataclass(kw_only=True, slots=True)
class WandbConfig:
    """Weights & Biases: the run's scalars (TensorBoard's tags at TensorBoard's steps) and its
    resolved config, logged by the driver only (`rl.metrics.wandb_sink`)."""
    enabled: bool = False
    """Log to W&B; needs the `wandb` extra (`pip install -e '.[wandb]'`), checked at submit."""
    project: str = "slurm-rl"
    """The W&B project."""
    entity: str | None = None
    """The W&B entity (user or team); null = the logged-in user's default."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """`online`: stream to the server (needs `wandb login` or WANDB_API_KEY); `offline`: write
    RUN_DIR/wandb/offline-run-* only, no network (upload later with `wandb sync`); `disabled`:
    log nothing, as `enabled: false`."""
    name: str | None = None
    """The W&B run's display name; null = the run's `name`."""
    tags: list[str] = field(default_factory=list)
    """Tags of the W&B run."""

    def __post_init__(self) -> None:
        _check(bool(self.project.strip()), "project", self.project, "a non-empty project name")


@dataclass(kw_only=True, slots=True)
class MlflowConfig:
    """MLflow: the run's scalars (TensorBoard's tags at TensorBoard's steps) and its resolved
    config as params, logged by the driver only (`rl.metrics.mlflow_sink`)."""
    enabled: bool = False
    """Log to MLflow; needs the `mlflow` extra (`pip install -e '.[mlflow]'`), checked at
    submit."""
    tracking_uri: str | None = None
    """MLflow tracking URI (`http://host:5000`, `databricks`, `sqlite:///path.db`, `file:/dir`);
    null = a file store in RUN_DIR/mlruns (no server, no network: `mlflow ui
    --backend-store-uri RUN_DIR/mlruns`)."""
    experiment: str | None = None
    """The MLflow experiment (created if missing); null = the run's `name`."""
    run_name: str | None = None
    """The MLflow run's name; null = the run's `name`."""

    def __post_init__(self) -> None:
        for name in ("tracking_uri", "experiment", "run_name"):
            value = getattr(self, name)
            _check(value is None or bool(value.strip()), name, value, "null or a non-empty string")


@dataclass(kw_only=True, slots=True)
class LoggingConfig:
    tensorboard: bool = True
    """Write the scalar metrics to RUN_DIR/tensorboard."""
    hdf5: bool = True
    """Log every sample (token ids, log-probs, reward, advantage, versions) to
    RUN_DIR/trajectories.h5."""
    print_every: int = 1
    """Print the driver's step line every N steps (evaluation steps and the last step always);
    metrics.jsonl gets every step."""
    save_routing: bool = False
    """With algorithm.routing_replay r3: also write each sample's routing (the engine's expert ids,
    layers x top_k bytes per token) to trajectories.h5."""
    verbose: bool = False
    """Print everything the job's libraries write (vLLM, Ray workers, DeepSpeed, transformers,
    warnings) on the console. Off: the console shows the step lines, progress, the summary and
    errors, and the rest goes to RUN_DIR/logs/job.log."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases: the same scalars as TensorBoard, and the config (off by default)."""
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    """MLflow: the same scalars as TensorBoard, and the config as params (off by default)."""

    def __post_init__(self) -> None:
        _positive(self, "print_every")


@dataclass(kw_only=True, slots=True)
class SlurmGroupConfig:
    nodes: int = 1
    """Nodes of this component of the heterogeneous job."""
    gpus_per_node: int = 0
    """GPUs per node (`--gpus-per-node`); 0 = none requested."""
    cpus_per_node: int = 2
    """CPUs of the node's one task (`--cpus-per-task`); 0 = Slurm's default."""
    mem_gb: float = 0.0
    """0 = Slurm's default."""
    partition: str | None = None
    """Slurm partition; null = the cluster's default."""
    constraint: str | None = None
    """Required node features (`--constraint`); null = any node."""
    time_min: int = 60
    """Time limit [minutes] (`--time`)."""

    def __post_init__(self) -> None:
        _positive(self, "nodes", "time_min")
        _non_negative(self, "gpus_per_node", "cpus_per_node", "mem_gb")


_GDR_LEVELS = ("LOC", "PIX", "PXB", "PHB", "SYS")
_NCCL_DEBUG = ("VERSION", "WARN", "INFO", "TRACE")


@dataclass(kw_only=True, slots=True)
class NetworkConfig:
    """NCCL / RDMA settings, exported by the Slurm job script (`slurm.params.network_env`) so
    every srun step, Ray worker and actor inherits them. null = NCCL's own default (not set)."""
    ib_hca: str | None = None
    """NCCL_IB_HCA: the HCAs/ports NCCL uses, e.g. `mlx5` or `=mlx5_0:1,mlx5_3:1` (`^mlx5_1`
    excludes one); list the compute fabric's, not storage or management HCAs."""
    socket_ifname: str | None = None
    """NCCL_SOCKET_IFNAME: the IP interface for NCCL's bootstrap and TCP fallback, e.g. `ib0`,
    `=bond0` (exact), `^lo,docker` (exclude)."""
    gloo_socket_ifname: str | None = None
    """GLOO_SOCKET_IFNAME: the interface of gloo groups (CPU collectives, the weight-sync store)
    when the default one is not the fabric's; plain names only (`ib0` or `ib0,ib1`)."""
    ib_gid_index: int | None = None
    """NCCL_IB_GID_INDEX: the GID carrying RoCE v2 (often 3); not needed on InfiniBand."""
    net_gdr_level: str | None = None
    """NCCL_NET_GDR_LEVEL: how far a NIC may be from a GPU for GPUDirect RDMA: LOC, PIX, PXB,
    PHB or SYS (see `nvidia-smi topo -m`)."""
    ib_timeout: int | None = None
    """NCCL_IB_TIMEOUT (4.096 us x 2^value; e.g. 22 on large or busy fabrics)."""
    ib_retry_cnt: int | None = None
    """NCCL_IB_RETRY_CNT (e.g. 7)."""
    ib_disable: bool = False
    """NCCL_IB_DISABLE=1: TCP sockets only (to tell a fabric problem from a code problem; very
    slow for large models)."""
    debug: str | None = None
    """NCCL_DEBUG: VERSION, WARN, INFO or TRACE (INFO once, to see NET/IB and GDRDMA)."""
    debug_subsys: str | None = None
    """NCCL_DEBUG_SUBSYS, e.g. `INIT,NET`."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """Further NCCL_*, UCX_* or GLOO_* variables exported as given (name -> value)."""

    def __post_init__(self) -> None:
        for name in ("ib_hca", "socket_ifname", "gloo_socket_ifname", "debug_subsys"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value.strip() != ""
                                     and not any(c.isspace() for c in value)),
                   name, value, "null or a non-empty string without spaces")
        for name in ("ib_gid_index", "ib_timeout", "ib_retry_cnt"):
            value = getattr(self, name)
            _check(value is None or value >= 0, name, value, "null or a value >= 0")
        _check(self.gloo_socket_ifname is None
               or re.fullmatch(r"[\w.:-]+(,[\w.:-]+)*", self.gloo_socket_ifname) is not None,
               "gloo_socket_ifname", self.gloo_socket_ifname,
               "interface names such as ib0 or ib0,ib1 (gloo has no ^ or = prefixes)")
        _check(self.net_gdr_level in (None, *_GDR_LEVELS), "net_gdr_level", self.net_gdr_level,
               f"null or one of {', '.join(_GDR_LEVELS)}")
        _check(self.debug in (None, *_NCCL_DEBUG), "debug", self.debug,
               f"null or one of {', '.join(_NCCL_DEBUG)}")
        bad = [k for k in self.extra_env if not re.fullmatch(r"(NCCL|UCX|GLOO)_[A-Z0-9_]+", k)]
        _check(not bad, "extra_env", bad, "names NCCL_*, UCX_* or GLOO_* (upper case)")


@dataclass(kw_only=True, slots=True)
class DeadlinesConfig:
    """How long the driver waits for each remote call of a worker group [s]. Past it the call
    fails with `CallTimeout` (naming the call, the ranks that did not answer and the key here),
    the run fails and the job is requeued or restarted from its newest checkpoint. Generous by
    default: a deadline only has to end a hang, never a slow but healthy call. The weight update
    has its own limit, `sync.timeout_s` (plus 60 s for the whole update)."""
    start_s: float = 1800.0
    """The workers' start: each trainer rank and engine built and answering (model load,
    DeepSpeed's first extension build, vLLM's start)."""
    train_s: float = 3600.0
    """One RL step's training on every trainer rank (all PPO epochs and mini-batches)."""
    generate_s: float = 7200.0
    """One generation on the rollout engines (a step's batch, an evaluation), counted from its
    launch: a batch generated ahead waits behind the ones before it on the same engine."""
    score_s: float = 1800.0
    """Log-prob scoring (the `sync.check_logprobs` probe) on the trainer ranks or the engines."""
    save_s: float = 3600.0
    """The trainer ranks writing, fsyncing and hashing their part of a checkpoint."""
    load_s: float = 3600.0
    """The trainer ranks loading a checkpoint, and hashing its files to verify it on resume."""
    call_s: float = 300.0
    """Short control calls: pings, weight versions, busy times, the sync plan and address."""

    def __post_init__(self) -> None:
        _positive(self, "start_s", "train_s", "generate_s", "score_s", "save_s", "load_s",
                  "call_s")


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    kind: Literal["local", "slurm"] = "local"
    """`local`: this machine (submitit's local executor, Ray started locally); `slurm`: one
    heterogeneous Slurm job."""
    trainer: SlurmGroupConfig = field(default_factory=lambda: SlurmGroupConfig(nodes=2))
    """kind slurm: the trainer component's resources."""
    rollout: SlurmGroupConfig = field(default_factory=SlurmGroupConfig)
    """kind slurm: the rollout component's resources."""
    max_requeues: int = 3
    """The job requeues itself (`scontrol requeue`) after a stop signal or a failure (a crash, a
    lost node, a call past its deadline) while SLURM_RESTART_COUNT < max_requeues; then it stops
    (resubmit to resume). A local run restarts itself after a failure up to this many times.
    Preemption requeues are Slurm's own and are not capped by this."""
    max_failures_without_progress: int = 3
    """Crash-loop guard: after this many failures in a row with no new checkpoint between them
    the job is not requeued (or restarted) again but ends failed: a deterministic crash must not
    use up every requeue."""
    deadlines: DeadlinesConfig = field(default_factory=DeadlinesConfig)
    """How long the driver waits for each remote call (`CallTimeout` past it)."""
    signal_before_end_s: int = 120
    """Slurm sends USR2 (submitit's preemption signal) this long before the time limit; with
    preemption grace time the same signal announces a preemption."""
    ray_start_timeout_s: float = 120.0
    """kind slurm: seconds for the Ray head to listen and every node to join (the job tries
    twice)."""
    placement_timeout_s: float = 300.0
    """Seconds to wait for Ray to place the trainer and rollout actors (and a replacement
    engine)."""
    ray_object_store_mb: int = 0
    """Ray object store per node [MiB]; 0 = Ray's default (30% of the node's RAM)."""
    slurm_params: dict[str, str] = field(default_factory=dict)
    """Extra sbatch options applied to both components (validated against a table)."""
    network: NetworkConfig = field(default_factory=NetworkConfig)
    """kind slurm: NCCL / RDMA settings the job script exports (HCAs, interface, GID index)."""

    def num_nodes(self, group: Literal["trainer", "rollout"]) -> int:
        """Machines the group spans: its `nodes` under Slurm; a local run is one machine."""
        return getattr(self, group).nodes if self.kind == "slurm" else 1

    def __post_init__(self) -> None:
        _non_negative(self, "max_requeues", "signal_before_end_s", "ray_object_store_mb")
        _positive(self, "ray_start_timeout_s", "placement_timeout_s",
                  "max_failures_without_progress")


@dataclass(kw_only=True, slots=True)
class SftConfig:
    steps: int = 300
    """Optimizer steps of the SFT warm start (with `target_accuracy`: at most this many)."""
    target_accuracy: float | None = None
    """Stop the warm start at the first check (every `check_every` steps) whose greedy accuracy on
    `check_examples` training problems reaches this; null: always `steps` steps. Pins the warm
    start's level rather than its step count: on a task learned in a sudden jump, a fixed step
    count lands before or after the jump depending on the CPU's rounding."""
    check_every: int = 10
    """Steps between the checks of `target_accuracy`."""
    check_examples: int = 256
    """Training problems (the first ones; never the eval split) greedily decoded at each check."""
    batch_size: int = 64
    """Examples per SFT step, drawn with replacement from the training set."""
    lr: float = 3e-3
    """Peak AdamW learning rate of the warm start (linear warmup, then cosine decay to 0)."""
    warmup_steps: int = 20
    """Steps of linear learning-rate warmup."""
    cache_dir: str = "checkpoints/sft"
    """Where warm starts are cached: one directory per model, data, seed and sft settings
    (cache_dir itself aside)."""
    target_field: str | None = None
    """A data field holding the text to imitate instead of the answer (e.g. a tool-use
    transcript, `rl.envs.calc`; the tokenizer's EOS text inside it is the EOS token), used
    where a row has it; null: always the answer. The warm start trains on all of it, tool
    results included (RL masks those)."""

    def __post_init__(self) -> None:
        _positive(self, "steps", "batch_size", "lr", "check_every", "check_examples")
        _non_negative(self, "warmup_steps")
        if self.target_accuracy is not None:
            _check(0 < self.target_accuracy <= 1, "target_accuracy", self.target_accuracy,
                   "null or a fraction in (0, 1]")


@dataclass(kw_only=True, slots=True)
class PlanConfig:
    """Inputs of the memory planner and its step-time estimate (`python -m launch.plan`, checked
    by `launch.submit`).

    Memory sizes are GiB (2**30 bytes). What the trainer runs (offload, activation checkpointing,
    attention kernel) is `trainer.`'s; the planner reads it from there.
    """
    gpu_memory_gb: float = 140.0
    """Memory of one GPU: H200 140 (141 GB nominal; CUDA reports ~139.8 GiB), H100 79, MI300X 192."""
    host_memory_gb: float = 2048.0
    """RAM of one trainer node usable for offloaded state (DGX H200: 2 TiB). If
    `cluster.trainer.mem_gb` is set, the smaller of the two is used (Slurm caps the job there)."""
    nvme_gb: float = 0.0
    """Local NVMe of one trainer node for `optimizer_offload: nvme` (DGX H200: 8 x 3.84 TB, ~28600)."""
    overhead_gb: float = 5.0
    """Per-GPU memory outside the estimate: CUDA context, NCCL buffers, allocator slack; on the
    rollout side also vLLM's profiled activation peak and CUDA graphs."""
    model_config: str | None = None
    """A config.json to plan with when `model.path` is not present on this machine (the
    planner reads only config.json, never weights)."""
    # Step-time estimate (rl/plan/timing.py). Rates default to the `device` preset; each preset
    # states its figures and where they come from (`rl.plan.timing.DEVICES`).
    device: Literal["h200", "mi300x"] = "h200"
    """Device preset for the step-time estimate's rates: `h200` (measured in bench/results, IB
    from the DGX H200 datasheet) or `mi300x` (datasheet figures); the figures are
    `rl.plan.timing.DEVICES`. Memory is `gpu_memory_gb`'s, not the preset's."""
    matmul_tflops: float | None = None
    """BF16 dense matmul rate of one GPU [TFLOP/s]; null = the `device` preset's (measured in
    bench/results/train.json for h200)."""
    hbm_gbps: float | None = None
    """HBM bandwidth of one GPU [GB/s, bytes read + written], what decode steps stream weights
    and KV cache at; null = the `device` preset's (a device-to-device copy measured in
    bench/results/rollout.json for h200)."""
    intra_node_gbps: float | None = None
    """NVLink / xGMI bandwidth per GPU inside a node [GB/s], for collectives among one node's
    GPUs and a same-node weight sync; null = the `device` preset's (an NCCL broadcast measured
    in bench/results/weight_sync.json for h200)."""
    inter_node_gbps: float | None = None
    """InfiniBand / RoCE bandwidth per GPU between nodes [GB/s]: collectives spanning nodes and the
    trainer -> rollout weight sync; null = the preset's (one 400 Gb/s NIC per GPU: 50)."""
    mfu: float = 0.195
    """Fraction of `matmul_tflops` that passes over many tokens reach, counting every FLOP run
    (trainer: old-log-prob forward, forward, backward, recompute; rollout: prefill), in (0, 1].
    Default fitted on bench/results/train.json (Qwen3-0.6B, ZeRO-2, 1 x H200); the fit and where
    it misses: docs/planner.md."""
    sync_efficiency: float = 0.496
    """Fraction of the link bandwidth the weight sync reaches end to end (packing, quantising,
    loading included), in (0, 1]. Default fitted on bench/results/weight_sync.json (FP8 wire);
    the fit and where it misses: docs/planner.md."""
    decode_step_overhead_ms: float = 1.04
    """Fixed cost of one decode step besides streaming weights and KV cache [ms]: kernel launch
    floors and sampling. Default fitted on bench/results/rollout.json (native BF16, Qwen3-0.6B,
    batch 64, 1,024 new tokens); the fit and where it misses: docs/planner.md."""

    def __post_init__(self) -> None:
        _positive(self, "gpu_memory_gb", "host_memory_gb")
        _non_negative(self, "nvme_gb", "overhead_gb", "decode_step_overhead_ms")
        for name in ("matmul_tflops", "hbm_gbps", "intra_node_gbps", "inter_node_gbps"):
            value = getattr(self, name)
            _check(value is None or value > 0, name, value, "null or a value > 0")
        for name in ("mfu", "sync_efficiency"):
            value = getattr(self, name)
            _check(0 < value <= 1, name, value, "a value in (0, 1]")
        _check(self.model_config is None or bool(self.model_config), "model_config",
               self.model_config, "null or a path to a config.json")


@dataclass(kw_only=True, slots=True)
class Config:
    name: str = "run"
    """Run name; the same name and output_dir resumes the run."""
    output_dir: str = "checkpoints"
    """Runs live in `output_dir/name`."""
    seed: int = 0
    """Seed of the run's data (synthetic task, eval split, prompt sampler), trainer and SFT; >= 0."""
    num_steps: int = 20
    """RL steps (rollout, train, weight sync); a resumed run continues up to this step."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model: a preset or a Hugging Face directory."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and answers: synthetic arithmetic or your files."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """How responses are scored."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn, tool-using rollouts against an environment (off unless env.path is set)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The rollout engines and their sampling."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The DeepSpeed trainer ranks and their optimizer."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """GRPO/PPO objective, batch size and asynchrony."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """Weight updates from the trainer to the engines."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints, retention and fault limits."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """TensorBoard, the HDF5 trajectory log, the step line, W&B and MLflow."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Where the run goes: this machine or a Slurm job."""
    sft: SftConfig = field(default_factory=SftConfig)
    """The SFT warm start (model.warm_start)."""
    plan: PlanConfig = field(default_factory=PlanConfig)
    """Inputs of the memory planner and its step-time estimate (`launch.plan`)."""

    def __post_init__(self) -> None:
        _non_negative(self, "num_steps", "seed")
        _check(bool(self.name) and "/" not in self.name, "name", self.name,
               "a non-empty name without '/'")
        pt = self.algorithm.partial_tokens
        budget = ("env.max_response_tokens" if self.env.path else "rollout.max_new_tokens")
        _check(pt is None or pt < self.response_budget, "algorithm.partial_tokens", pt,
               f"null or a value < {budget} ({self.response_budget})")
        _check(self.algorithm.overlong_buffer <= self.response_budget,
               "algorithm.overlong_buffer", self.algorithm.overlong_buffer,
               f"a value <= {budget} ({self.response_budget})")
        _check(not self.algorithm.dynamic_sampling or self.rollout.n_samples >= 2,
               "algorithm.dynamic_sampling", self.algorithm.dynamic_sampling,
               "false when rollout.n_samples is 1 (a group of one sample has no reward spread)")
        _check(not self.trainer.pack_sequences or self.algorithm.routing_replay == "off",
               "trainer.pack_sequences", True, "false with algorithm.routing_replay r2 or r3 "
               "(the replayed routing is laid out per padded row)")
        _check(not self.logging.save_routing or self.algorithm.routing_replay == "r3",
               "logging.save_routing", True, "false unless algorithm.routing_replay is r3 (only "
               "r3 asks the engines for routing)")
        # The presets' character tokenizer cannot hold V4's markers (they would become <unk>),
        # and growing its fixed vocabulary would change every preset; refuse here, before a
        # tokenizer is built. model.path tokenizers are checked where prompts are encoded.
        _check(self.model.path is not None or self.data.format != "deepseek_v4",
               "data.prompt_format", self.data.prompt_format,
               f"raw or chat_template with a preset model ({self.model.preset}: its character "
               "tokenizer has no <｜User｜>, <｜Assistant｜>, <think> tokens); deepseek_v4 needs "
               "a DeepSeek-V4 checkpoint in model.path")
        env = self.env
        _check(env.path is None or env.max_response_tokens < self.rollout.max_model_len,
               "env.max_response_tokens", env.max_response_tokens,
               f"a value < rollout.max_model_len ({self.rollout.max_model_len})")
        if self.reward.answer_after == "auto":
            # Resolved here, where the prompt format is known: RewardComputer gets only
            # cfg.reward. A new object, so a RewardConfig given to two Configs resolves in each.
            self.reward = dataclasses.replace(self.reward, answer_after=(
                THINK_END if self.data.format == "deepseek_v4" and self.data.deepseek_v4.thinking
                else None))

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name

    @property
    def response_budget(self) -> int:
        """Tokens a training response may hold: a multi-turn episode's env.max_response_tokens
        (model and environment tokens), else rollout.max_new_tokens. The overlong penalty
        counts against it."""
        return self.env.max_response_tokens if self.env.path else self.rollout.max_new_tokens

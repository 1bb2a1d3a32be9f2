"""Find, load and build model directories: a local HF checkpoint (`ModelConfig.path`) or a preset.

Loading never touches the network (HF_HUB_OFFLINE-safe): everything is a local directory.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedModel
from transformers import PreTrainedTokenizerBase

from rl.config import ConfigError, ModelConfig
from rl.models.attention import EAGER_ONLY, attention_kernel
from rl.models.hf_classes import transformers_classes
from rl.models.presets import build_preset, preset_dir_name

DEFAULT_CACHE_ROOT = Path("checkpoints/models")
# MLA architectures (`rl.rollout.vllm_cpu.MLA_MODEL_TYPES`): vLLM-CPU's fused rotary op
# (`_C.rotary_embedding`) rotates strided inputs wrongly, and MLA's q_pe / k_pe are strided
# slices, so the engine must use vLLM's torch rotary (`vllm_cpu_overrides`).


def resolve_model_dir(cfg: ModelConfig, cache_root: Path = DEFAULT_CACHE_ROOT) -> Path:
    """The directory to load for `cfg`.

    `cfg.path` is returned as-is once it is checked to hold a config.json (ConfigError naming
    `model.path` otherwise). A preset resolves to `cache_root/<preset>-seed<seed>-<fingerprint>`
    (`preset_dir_name`: the fingerprint hashes the preset's fields), built on first use and reused
    afterwards (the build is deterministic, so a reused directory is what a fresh build would
    write).
    """
    if cfg.path is not None:
        path = Path(cfg.path)
        if not path.is_dir():
            raise ConfigError(f"model.path: {str(path)!r} is not a directory "
                              "(expected a local Hugging Face checkpoint directory)")
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path: {str(path)!r} has no config.json "
                              "(expected a local Hugging Face checkpoint directory)")
        return path
    out_dir = Path(cache_root) / preset_dir_name(cfg.preset, cfg.seed)  # type: ignore[arg-type]  # lint baseline (issue 39)
    if not (out_dir / "config.json").is_file():
        try:
            build_preset(cfg.preset, out_dir, seed=cfg.seed)  # type: ignore[arg-type]  # lint baseline (issue 39)
        except FileExistsError:  # another process (a second rank) finished it first
            if not (out_dir / "config.json").is_file():
                raise
    return out_dir


def model_type(model_dir: Path) -> str:
    """`model_type` from `model_dir/config.json`."""
    return json.loads((Path(model_dir) / "config.json").read_text())["model_type"]


def refuse_quantized(model_dir: Path) -> None:
    """ConfigError (one line, naming the converter) if `model_dir` is a quantized checkpoint.

    The trainer needs BF16/fp32 parameters: `from_pretrained` would keep FP8 weights as FP8 (on
    GPUs) or fail on FP4-packed int8 experts, and AdamW cannot train either. Detected from
    config.json's `quantization_config` or from any FP8 / int8 / uint8 tensor in the shards'
    headers (no tensor data is read).
    """
    from rl.models.convert.source import QUANTIZED_DTYPES, read_header

    model_dir = Path(model_dir)
    fix = (f"the trainer needs BF16: convert it first with `python -m launch.convert "
           f"{model_dir} --trainer-out DIR` and point model.path at DIR")
    qc = json.loads((model_dir / "config.json").read_text()).get("quantization_config")
    if qc:
        method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
        raise ConfigError(f"model.path: {str(model_dir)!r} is a quantized checkpoint "
                          f"(config.json quantization_config, quant_method {method}); {fix}")
    for shard in sorted(model_dir.glob("*.safetensors")):
        for name, (dtype, _) in read_header(shard).items():
            if dtype in QUANTIZED_DTYPES:
                raise ConfigError(f"model.path: {str(model_dir)!r} is a quantized checkpoint "
                                  f"({shard.name}: {name} is {dtype}); {fix}")


def load_model(model_dir: Path, dtype: torch.dtype, device: str | torch.device = "cpu",
               attention: str = "auto", runs_on: str | torch.device | None = None
               ) -> PreTrainedModel:
    """Load a causal LM from `model_dir` in `dtype`, on `device`, in eval mode; `runs_on`: the
    device it will compute on when that is not `device` (a trainer loads on the host and
    DeepSpeed moves it).

    Parameters are `dtype` except those the architecture pins to fp32
    (`model._keep_in_fp32_modules_strict`: DeepSeek-V4's norms, hyper-connection mixers, sinks,
    e_score_correction_bias); integer buffers (`tid2eid`) stay integer. Attention (the rule is
    `rl.models.attention.attention_kernel`): SDPA; for DeepSeek-V4, whose HF code is eager-only,
    our linear-memory `rl.models.v4_attention` (same outputs), or transformers' eager with
    `attention="eager"`. DeepSeek-V4's norms compute in fp32 and return `dtype`
    (`rl.models.v4_precision`), so a BF16 V4 runs end to end. Running on CUDA (or wherever
    `RL_V4_LAYER=1`; `RL_V4_LAYER=0` turns it off) its hyper-connections, norms and MoE run as
    `rl.models.v4_layer`'s fused functions (compiled on CUDA; same outputs to rounding).
    A quantized checkpoint is refused (`refuse_quantized`).
    """
    refuse_quantized(model_dir)
    kind = model_type(model_dir)
    fused_v4 = kind in EAGER_ONLY and attention_kernel(kind, attention) == "fused"
    attn = "eager" if kind in EAGER_ONLY else "sdpa"
    config_cls, model_cls = transformers_classes(kind)
    config = config_cls.from_pretrained(str(model_dir), local_files_only=True)
    model = model_cls.from_pretrained(str(model_dir), config=config, dtype=dtype,
                                      attn_implementation=attn, local_files_only=True)
    if kind == "deepseek_v4":
        from rl.models import v4_layer, v4_precision
        v4_precision.install(model)
        if v4_layer.requested(device if runs_on is None else runs_on):
            v4_layer.install(model)
    if fused_v4:
        from rl.models.v4_attention import install
        install(model)
    return model.to(device).eval()


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in `model_dir`; pad_token falls back to eos_token when missing."""
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


def vllm_cpu_overrides(model_dir: Path, dtype: torch.dtype) -> dict:
    """Extra `vllm.LLM(...)` arguments this model needs on vLLM-CPU in `dtype` to load on every
    CPU and match HF numerically.

    For MLA models: `compilation_config={"custom_ops": ["all", "-rotary_embedding"]}` (with
    vLLM-CPU's own rotary kernel tiny-deepseek-v3's log-probs differ from HF by ~1e-2: positions
    are encoded wrongly; with the torch rotary they agree to ~5e-7), and unless `dtype` is bf16
    the `CPU_MLA` attention backend by name (`rl.rollout.vllm_cpu.mla_overrides`: vLLM's AMX one,
    its pick on CPUs with AMX, refuses fp32 weights). Empty for other models.
    """
    from rl.rollout.vllm_cpu import MLA_MODEL_TYPES, mla_overrides

    if model_type(model_dir) in MLA_MODEL_TYPES:
        return {"compilation_config": {"custom_ops": ["all", "-rotary_embedding"]},
                **mla_overrides(dtype)}
    return {}

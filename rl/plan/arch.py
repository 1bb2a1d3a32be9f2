"""A model's parameter tensors from its config.json alone, by formula per architecture.

`parse(config, source)` turns a Hugging Face config dict into an `Arch`: the list of parameter
tensors the transformers 5.x implementation creates (same names and shapes as
`model.named_parameters()`), plus the fields the KV-cache and activation estimates need. Nothing
here imports torch or transformers: planning a 284B model must take milliseconds on a laptop.

Supported `model_type`s: qwen3 (dense GQA), qwen3_moe, deepseek_v3 (MLA + MoE), deepseek_v4
(compressed sparse / heavily compressed attention, hyper-connections, MoE). Multi-token-prediction
layers (`num_nextn_predict_layers`) are not counted: transformers does not build them and the
published totals (671B, 284B) exclude them.
"""
from __future__ import annotations

import fnmatch
import math
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rl.config import ConfigError

SUPPORTED = ("qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v4")

# Mirrors rl.quant.policy.DEFAULT_KEEP_BF16 (a test pins the two together; importing rl.quant
# here would import torch, seconds we cannot spend).
KEEP_BF16 = ("*embed_tokens*", "*embed.weight", "lm_head*", "*.lm_head*", "head.weight",
             "*.mlp.gate.weight", "*.mlp.router.*", "*shared_expert_gate*", "*norm*",
             # DeepSeek-V4 checkpoint names (the weight stream's); the planner's HF names use
             # KEEP_BF16_V4 below
             "*.ffn.gate.weight", "*.indexer.weights_proj.weight", "*.compressor.wkv.weight",
             "*.compressor.wgate.weight")
# DeepSeek-V4's published checkpoint ships its compressor / indexer projections in BF16 (no FP8
# scales), and transformers' FP8 quantizer skips them; a V4 FP8 engine keeps them too.
KEEP_BF16_V4 = ("*.compressor.kv_proj.weight", "*.compressor.gate_proj.weight",
                "*.indexer.kv_proj.weight", "*.indexer.gate_proj.weight", "*.weights_proj.weight")
_FUSED_EXPERT_SUFFIXES = (".gate_up_proj", ".down_proj", ".up_proj", ".gate_proj")
_KEEP_RX = re.compile("|".join(fnmatch.translate(p) for p in KEEP_BF16))
_KEEP_RX_V4 = re.compile("|".join(fnmatch.translate(p) for p in KEEP_BF16 + KEEP_BF16_V4))
FP8_BLOCK = 128


class ModelConfigError(ConfigError):
    """config.json lacks a field the planner needs, or holds an unsupported architecture."""


@dataclass(frozen=True, slots=True)
class Tensor:
    """One parameter tensor. `tp_shards`: the most ways vLLM's tensor parallelism splits it
    (None = any TP size; 1 = replicated on every rank; k = at most k ways, e.g. GQA's k/v
    projections with k KV heads). `routed`: a routed-expert stack (E, N, K), of which a token
    uses top_k / E."""
    name: str
    shape: tuple[int, ...]
    tp_shards: int | None = None
    routed: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def module(self) -> str:
        """The owning module's name: the unit ZeRO-3 gathers at once."""
        return self.name.rsplit(".", 1)[0]


@dataclass(frozen=True, slots=True)
class Arch:
    """What the planner knows about a model. Counts are parameters (elements), not bytes."""
    model_type: str
    source: str
    """Where the config came from (a path, or `known:<name>`), for messages."""
    config: dict
    tensors: tuple[Tensor, ...]
    num_layers: int
    hidden: int
    vocab: int
    top_k: int = 0
    num_experts: int = 0
    layer_types: tuple[str, ...] = ()
    """Per layer: the attention kind (`full`, `mla`, or V4's `sliding_attention`, ...)."""
    mlp_kinds: tuple[str, ...] = ()
    """Per layer: `dense` or `moe`."""
    notes: tuple[str, ...] = field(default=())
    memo: dict = field(default_factory=dict, compare=False, repr=False)
    """Results of pure functions of this Arch (suggestions re-plan many times)."""

    def memoised(self, key: str, compute: Callable[[], Any]) -> Any:
        """`compute()`, once per Arch (`launch.plan --search` and the suggestions re-plan the
        same model hundreds of times; a 284B model has ~5,600 tensors to sum)."""
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]

    @property
    def total_params(self) -> int:
        return self.memoised("total_params", lambda: sum(t.numel for t in self.tensors))

    @property
    def active_params(self) -> int:
        """Parameters one token's forward multiplies by: all but the unselected routed experts
        and the input embedding table (a row lookup, not a matmul).

        This is DeepSeek's convention (V3 "37B": 36.6B; V4-Flash "13B": 13.3B). Qwen's "3.3B
        activated" for Qwen3-30B-A3B also counts the input embedding (3.04B + 0.31B).
        """
        unused = 0.0
        if self.num_experts:
            routed = self.memoised("routed_params",
                                   lambda: sum(t.numel for t in self.tensors if t.routed))
            unused = routed * (1 - self.top_k / self.num_experts)
        return round(self.total_params - unused - self.input_embedding_params)

    @property
    def input_embedding_params(self) -> int:
        return self.memoised("input_embedding_params", lambda: sum(
            t.numel for t in self.tensors if t.name == "model.embed_tokens.weight"))

    def largest_module(self) -> int:
        """Parameters of the largest module (ZeRO-3 gathers a module's parameters together)."""
        if "largest_module" not in self.memo:
            sizes: dict[str, int] = defaultdict(int)
            for t in self.tensors:
                sizes[t.module] += t.numel
            self.memo["largest_module"] = max(sizes.values())
        return self.memo["largest_module"]


def field_of(c: dict, source: str, *keys: str, default: Any = ...) -> Any:
    for k in keys:
        if c.get(k) is not None:
            return c[k]
    if default is ...:
        raise ModelConfigError(f"{source}: config.json has no {' / '.join(keys)} "
                               f"(needed to plan a {c.get('model_type')} model)")
    return default


def fp8_eligible(name: str, shape: tuple[int, ...], model_type: str = "") -> bool:
    """Same rule as `rl.quant.policy.should_quantize` (+ V4's BF16 checkpoint projections):
    2-D `*.weight` matrices and 3-D fused expert stacks, unless a keep pattern matches."""
    if len(shape) == 2:
        eligible = name.endswith(".weight")
    elif len(shape) == 3:
        eligible = name.endswith(_FUSED_EXPERT_SUFFIXES)
    else:
        eligible = False
    keep = _KEEP_RX_V4 if model_type == "deepseek_v4" else _KEEP_RX
    return eligible and keep.match(name) is None


def fp8_bytes(shape: tuple[int, ...], block: int = FP8_BLOCK) -> int:
    """e4m3 values plus fp32 scales per (block x block) tile of each (N, K) matrix."""
    *lead, n, k = shape
    return math.prod(shape) + 4 * math.prod(lead) * -(-n // block) * -(-k // block)


# --------------------------------------------------------------------------------------
# Per-architecture tensor lists (names and shapes as transformers 5.x builds them)
# --------------------------------------------------------------------------------------
def _norm(name: str, size: int) -> Tensor:
    return Tensor(f"{name}.weight", (size,), tp_shards=1)


def _layer_norms(layer: str, hidden: int) -> list[Tensor]:
    return [_norm(f"{layer}.input_layernorm", hidden),
            _norm(f"{layer}.post_attention_layernorm", hidden)]


def _linear(name: str, out_f: int, in_f: int, bias: bool = False, tp_shards: int | None = None
            ) -> list[Tensor]:
    ts = [Tensor(f"{name}.weight", (out_f, in_f), tp_shards)]
    if bias:
        ts.append(Tensor(f"{name}.bias", (out_f,), tp_shards))
    return ts


def _swiglu(name: str, hidden: int, inter: int) -> list[Tensor]:
    return (_linear(f"{name}.gate_proj", inter, hidden) + _linear(f"{name}.up_proj", inter, hidden)
            + _linear(f"{name}.down_proj", hidden, inter))


def _experts(name: str, num: int, hidden: int, inter: int) -> list[Tensor]:
    return [Tensor(f"{name}.gate_up_proj", (num, 2 * inter, hidden), routed=True),
            Tensor(f"{name}.down_proj", (num, hidden, inter), routed=True)]


def _ends(c: dict, src: str, hidden: int, vocab: int) -> tuple[list[Tensor], list[Tensor]]:
    head = [Tensor("model.embed_tokens.weight", (vocab, hidden))]
    tail = [_norm("model.norm", hidden)]
    if not c.get("tie_word_embeddings", False):
        tail.append(Tensor("lm_head.weight", (vocab, hidden)))
    return head, tail


def _gqa_attention(c: dict, src: str, p: str, hidden: int) -> list[Tensor]:
    heads = field_of(c, src, "num_attention_heads")
    kv = field_of(c, src, "num_key_value_heads", default=heads)
    hd = field_of(c, src, "head_dim", default=hidden // heads)
    bias = bool(c.get("attention_bias", False))
    return (_linear(f"{p}.q_proj", heads * hd, hidden, bias)
            + _linear(f"{p}.k_proj", kv * hd, hidden, bias, tp_shards=kv)
            + _linear(f"{p}.v_proj", kv * hd, hidden, bias, tp_shards=kv)
            + _linear(f"{p}.o_proj", hidden, heads * hd, bias)
            + [_norm(f"{p}.q_norm", hd), _norm(f"{p}.k_norm", hd)])


def _qwen3(c: dict, src: str, moe: bool) -> Arch:
    hidden, vocab = field_of(c, src, "hidden_size"), field_of(c, src, "vocab_size")
    layers = field_of(c, src, "num_hidden_layers")
    experts = field_of(c, src, "num_experts", "num_local_experts", default=0) if moe else 0
    top_k = field_of(c, src, "num_experts_per_tok", default=0) if moe else 0
    sparse_step = c.get("decoder_sparse_step", 1) or 1
    mlp_only = set(c.get("mlp_only_layers") or [])
    tensors, kinds = _ends(c, src, hidden, vocab)[0], []
    for i in range(layers):
        p = f"model.layers.{i}"
        tensors += _gqa_attention(c, src, f"{p}.self_attn", hidden)
        if moe and i not in mlp_only and experts > 0 and (i + 1) % sparse_step == 0:
            inter = field_of(c, src, "moe_intermediate_size")
            tensors += _experts(f"{p}.mlp.experts", experts, hidden, inter)
            tensors += [Tensor(f"{p}.mlp.gate.weight", (experts, hidden), tp_shards=1)]
            kinds.append("moe")
        else:
            tensors += _swiglu(f"{p}.mlp", hidden, field_of(c, src, "intermediate_size"))
            kinds.append("dense")
        tensors += _layer_norms(p, hidden)
    tensors += _ends(c, src, hidden, vocab)[1]
    return Arch(c["model_type"], src, c, tuple(tensors), layers, hidden, vocab, top_k, experts,
                ("full",) * layers, tuple(kinds))


def _deepseek_v3(c: dict, src: str) -> Arch:
    hidden, vocab = field_of(c, src, "hidden_size"), field_of(c, src, "vocab_size")
    layers, heads = field_of(c, src, "num_hidden_layers"), field_of(c, src, "num_attention_heads")
    q_lora, kv_lora = c.get("q_lora_rank"), field_of(c, src, "kv_lora_rank")
    nope, rope = field_of(c, src, "qk_nope_head_dim"), field_of(c, src, "qk_rope_head_dim")
    v_dim, bias = field_of(c, src, "v_head_dim"), bool(c.get("attention_bias", False))
    experts, top_k = field_of(c, src, "n_routed_experts"), field_of(c, src, "num_experts_per_tok")
    first_dense = c.get("first_k_dense_replace", 0)
    inter_moe = field_of(c, src, "moe_intermediate_size")
    tensors, kinds = _ends(c, src, hidden, vocab)[0], []
    for i in range(layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        if q_lora is None:
            tensors += _linear(f"{a}.q_proj", heads * (nope + rope), hidden)
        else:  # vLLM runs the down-projections replicated (one small matrix per layer)
            tensors += _linear(f"{a}.q_a_proj", q_lora, hidden, bias, tp_shards=1)
            tensors += [_norm(f"{a}.q_a_layernorm", q_lora)]
            tensors += _linear(f"{a}.q_b_proj", heads * (nope + rope), q_lora)
        tensors += _linear(f"{a}.kv_a_proj_with_mqa", kv_lora + rope, hidden, bias, tp_shards=1)
        tensors += [_norm(f"{a}.kv_a_layernorm", kv_lora)]
        tensors += _linear(f"{a}.kv_b_proj", heads * (nope + v_dim), kv_lora)
        tensors += _linear(f"{a}.o_proj", hidden, heads * v_dim, bias)
        if i >= first_dense:
            tensors += _experts(f"{p}.mlp.experts", experts, hidden, inter_moe)
            tensors += [Tensor(f"{p}.mlp.gate.weight", (experts, hidden), tp_shards=1)]
            tensors += _swiglu(f"{p}.mlp.shared_experts", hidden,
                               inter_moe * c.get("n_shared_experts", 1))
            kinds.append("moe")
        else:
            tensors += _swiglu(f"{p}.mlp", hidden, field_of(c, src, "intermediate_size"))
            kinds.append("dense")
        tensors += _layer_norms(p, hidden)
    tensors += _ends(c, src, hidden, vocab)[1]
    return Arch("deepseek_v3", src, c, tuple(tensors), layers, hidden, vocab, top_k, experts,
                ("mla",) * layers, tuple(kinds))


V4_RATIO_TO_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention",
                    128: "heavily_compressed_attention"}


def v4_layer_types(c: dict, src: str) -> tuple[str, ...]:
    """V4's per-layer attention kinds: `layer_types`, else the checkpoint's `compress_ratios`
    (0 sliding-only, 4 CSA, 128 HCA; a trailing entry for the MTP layer is dropped), else
    transformers' default (2 HCA, then CSA / HCA alternating)."""
    n = field_of(c, src, "num_hidden_layers")
    if c.get("layer_types"):
        types = list(c["layer_types"])
    elif c.get("compress_ratios"):
        bad = [r for r in c["compress_ratios"] if r not in V4_RATIO_TO_TYPE]
        if bad:
            raise ModelConfigError(f"{src}: compress_ratios holds {sorted(set(bad))}, "
                                   "expected values in 0, 4, 128")
        types = [V4_RATIO_TO_TYPE[r] for r in c["compress_ratios"]]
    else:
        types = (["heavily_compressed_attention"] * min(n, 2)
                 + ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                    for i in range(max(n - 2, 0))])
    if len(types) < n:
        raise ModelConfigError(f"{src}: {len(types)} per-layer attention types for {n} layers")
    return tuple(types[:n])


def v4_compress_rates(c: dict) -> dict[str, int]:
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    rates.update(c.get("compress_rates") or {})
    if c.get("compress_rate_csa"):
        rates["compressed_sparse_attention"] = c["compress_rate_csa"]
    if c.get("compress_rate_hca"):
        rates["heavily_compressed_attention"] = c["compress_rate_hca"]
    return rates


def _deepseek_v4(c: dict, src: str) -> Arch:
    hidden, vocab = field_of(c, src, "hidden_size"), field_of(c, src, "vocab_size")
    layers, heads = field_of(c, src, "num_hidden_layers"), field_of(c, src, "num_attention_heads")
    hd, q_lora = field_of(c, src, "head_dim"), field_of(c, src, "q_lora_rank")
    groups, o_lora = field_of(c, src, "o_groups"), field_of(c, src, "o_lora_rank")
    experts, top_k = field_of(c, src, "n_routed_experts"), field_of(c, src, "num_experts_per_tok")
    inter = field_of(c, src, "moe_intermediate_size")
    idx_heads, idx_dim = field_of(c, src, "index_n_heads"), field_of(c, src, "index_head_dim")
    hc = field_of(c, src, "hc_mult", default=4)
    rates, types = v4_compress_rates(c), v4_layer_types(c, src)
    mix = (2 + hc) * hc  # hyper-connection mixer outputs: pre (hc) + post (hc) + comb (hc x hc)

    def hyper(p: str) -> list[Tensor]:
        return [Tensor(f"{p}.fn", (mix, hc * hidden), 1), Tensor(f"{p}.base", (mix,), 1),
                Tensor(f"{p}.scale", (3,), 1)]

    tensors = _ends(c, src, hidden, vocab)[0]
    for i, kind in enumerate(types):
        p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        tensors += [Tensor(f"{a}.sinks", (heads,))]
        tensors += _linear(f"{a}.q_a_proj", q_lora, hidden, tp_shards=1)
        tensors += [_norm(f"{a}.q_a_norm", q_lora)]
        tensors += _linear(f"{a}.q_b_proj", heads * hd, q_lora)
        tensors += _linear(f"{a}.kv_proj", hd, hidden, tp_shards=1) + [_norm(f"{a}.kv_norm", hd)]
        tensors += _linear(f"{a}.o_a_proj", groups * o_lora, heads * hd // groups, tp_shards=groups)
        tensors += _linear(f"{a}.o_b_proj", hidden, groups * o_lora)
        comp = f"{a}.compressor"
        if kind == "compressed_sparse_attention":  # two overlapping series: 2 x head_dim
            m = rates[kind]
            tensors += [Tensor(f"{comp}.position_bias", (m, 2 * hd), 1)]
            tensors += _linear(f"{comp}.kv_proj", 2 * hd, hidden, tp_shards=1)
            tensors += _linear(f"{comp}.gate_proj", 2 * hd, hidden, tp_shards=1)
            tensors += [_norm(f"{comp}.kv_norm", hd)]
            ix = f"{comp}.indexer"
            tensors += [Tensor(f"{ix}.position_bias", (m, 2 * idx_dim), 1)]
            tensors += _linear(f"{ix}.kv_proj", 2 * idx_dim, hidden, tp_shards=1)
            tensors += _linear(f"{ix}.gate_proj", 2 * idx_dim, hidden, tp_shards=1)
            tensors += [_norm(f"{ix}.kv_norm", idx_dim)]
            tensors += _linear(f"{ix}.q_b_proj", idx_heads * idx_dim, q_lora, tp_shards=1)
            tensors += _linear(f"{ix}.scorer.weights_proj", idx_heads, hidden, tp_shards=1)
        elif kind == "heavily_compressed_attention":
            m = rates[kind]
            tensors += [Tensor(f"{comp}.position_bias", (m, hd), 1)]
            tensors += _linear(f"{comp}.kv_proj", hd, hidden, tp_shards=1)
            tensors += _linear(f"{comp}.gate_proj", hd, hidden, tp_shards=1)
            tensors += [_norm(f"{comp}.kv_norm", hd)]
        # Hash-routed and top-k-routed layers both own a (E, H) gate; tid2eid is a buffer.
        tensors += [Tensor(f"{p}.mlp.gate.weight", (experts, hidden), tp_shards=1)]
        tensors += _experts(f"{p}.mlp.experts", experts, hidden, inter)
        # transformers builds ONE shared MLP of moe_intermediate_size (n_shared_experts is 1
        # in every published V4 config).
        tensors += _swiglu(f"{p}.mlp.shared_experts", hidden, inter)
        tensors += _layer_norms(p, hidden)
        tensors += hyper(f"{p}.attn_hc") + hyper(f"{p}.ffn_hc")
    tail = _ends(c, src, hidden, vocab)[1]
    tensors += tail[:1] + [Tensor("model.hc_head.hc_fn", (hc, hc * hidden), 1),
                           Tensor("model.hc_head.hc_base", (hc,), 1),
                           Tensor("model.hc_head.hc_scale", (1,), 1)] + tail[1:]
    notes: tuple[str, ...] = ()
    if c.get("n_shared_experts", 1) != 1:
        notes = (f"n_shared_experts={c['n_shared_experts']}: counted as one shared MLP, "
                 "as transformers builds it",)
    return Arch("deepseek_v4", src, c, tuple(tensors), layers, hidden, vocab, top_k, experts,
                types, ("moe",) * layers, notes)


def parse(config: dict, source: str) -> Arch:
    """The `Arch` of a config.json dict. Raises ModelConfigError naming `source`."""
    if not isinstance(config, dict):
        raise ModelConfigError(f"{source}: expected a JSON object, got {type(config).__name__}")
    # Multimodal wrappers keep the language model under text_config.
    c = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    model_type = c.get("model_type") or config.get("model_type")  # type: ignore[union-attr]  # lint baseline (issue 39)
    c = {**c, "model_type": model_type}  # type: ignore[dict-item]  # lint baseline (issue 39)
    if model_type == "qwen3":
        return _qwen3(c, source, moe=False)
    if model_type == "qwen3_moe":
        return _qwen3(c, source, moe=True)
    if model_type == "deepseek_v3":
        return _deepseek_v3(c, source)
    if model_type == "deepseek_v4":
        return _deepseek_v4(c, source)
    raise ModelConfigError(f"{source}: model_type {model_type!r} is not supported by the planner "
                           f"(supported: {', '.join(SUPPORTED)})")

"""KV-cache bytes per token on one tensor-parallel rank, from the model's real attention layout.

- GQA (qwen3, qwen3_moe): K and V for every KV head: `2 x kv_heads x head_dim x layers`. vLLM
  splits KV heads across TP ranks; with more ranks than KV heads each rank keeps one (replicas).
- MLA (deepseek_v3): one latent per token per layer, `kv_lora_rank + qk_rope_head_dim`, shared
  by all heads and therefore replicated on every TP rank.
- DeepSeek-V4: one shared K=V head per layer (replicated on every rank). Every layer keeps a
  sliding window of `sliding_window` raw entries (a per-sequence constant); compressed sparse
  attention (CSA) layers add one `head_dim` entry per `m` tokens plus one `index_head_dim`
  indexer key per `m` tokens; heavily compressed attention (HCA) layers add one `head_dim`
  entry per `m'` tokens (m=4, m'=128 in V4-Flash). The partial-window buffers and overlap state
  the compressors carry (< 2m tokens per layer) are ignored.

Units: bytes. `dtype_bytes` is 2 for a bf16 cache, 1 for fp8. `scale_bytes`: per token, KV head
and K or V, what an FP8 cache stores besides the values: 0 for vLLM (per-tensor scales),
`KV_FP8_SCALE_BYTES` for the native engine (one exponent byte, rl/rollout/native/kvcache.py).

`cache_dtype` (`rollout.kv_cache_dtype` of a vLLM engine on GPUs) matters for DeepSeek-V4 only:
vLLM 0.32's V4 attention (FlashMLA, its default backend) stores the cache in DeepSeek's packed
`fp8_ds_mla` layout and turns `auto` and `fp8` into it (`_resolve_dsv4_kv_cache_dtype` in
vllm/models/deepseek_v4/attention.py). Per entry, attention and sliding window alike: 448 B of
FP8 NoPE values + 128 B of BF16 RoPE values + 8 B of scales = 584 B (vLLM's constant, for V4's
head_dim 512); per indexer key: index_head_dim FP8 bytes + 4 B per 128 (132 B). `bfloat16` is
the plain-row layout of the FlashInfer sparse backend, 2 B per value.
"""
from __future__ import annotations

from dataclasses import dataclass

from rl.config import ConfigError
from rl.plan.arch import Arch, field_of, v4_compress_rates

DS_MLA_ENTRY_BYTES = 584
"""One fp8_ds_mla cache entry of DeepSeek-V4 (head_dim 512, rope 64): vLLM's
`state_content_bytes` / `packed_bytes_per_token`."""
_DS_MLA_NAMES = ("auto", "fp8", "fp8_ds_mla")
KV_FP8_SCALE_BYTES = 1
"""The native engine's FP8 cache: one power-of-two scale byte per (token, KV head) of K and V."""
KV_FP8_SLOT_ALIGN = 128
"""The native engine's FP8 cache rows hold whole 128-slot tiles of its decode attention."""


def native_fp8_slots(max_len: int) -> int:
    """Slots of one native-engine FP8 cache row: max_len rounded up to `KV_FP8_SLOT_ALIGN`."""
    return -(-max_len // KV_FP8_SLOT_ALIGN) * KV_FP8_SLOT_ALIGN


@dataclass(frozen=True, slots=True)
class KVLayout:
    """KV-cache cost on ONE tensor-parallel rank."""
    per_token: float
    """Bytes per token of context (grows with sequence length)."""
    per_sequence: float
    """Bytes per sequence independent of its length (V4's sliding windows; 0 otherwise)."""
    explain: tuple[str, ...]
    """How the numbers were obtained, one line each, for the report."""

    def sequence_bytes(self, tokens: int) -> float:
        """Bytes one sequence of `tokens` tokens holds."""
        return self.per_token * tokens + self.per_sequence


def _kib(n: float) -> str:
    return f"{n / 1024:,.1f} KiB"


def gqa_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int,
                        scale_bytes: int = 0) -> int:
    """K and V of one token over all layers; the native engine sizes its cache with this too."""
    return 2 * kv_heads * (head_dim * dtype_bytes + scale_bytes) * layers


def gqa(arch: Arch, tp: int, dtype_bytes: int, scale_bytes: int = 0) -> KVLayout:
    c, src = arch.config, arch.source
    heads = field_of(c, src, "num_attention_heads")
    kv = field_of(c, src, "num_key_value_heads", default=heads)
    hd = field_of(c, src, "head_dim", default=arch.hidden // heads)
    per_rank = -(-kv // tp) if tp <= kv else 1
    per_token = gqa_bytes_per_token(arch.num_layers, per_rank, hd, dtype_bytes, scale_bytes)
    scales = f" + {scale_bytes} B scale per head" if scale_bytes else ""
    split = (f"{per_rank} per rank at TP {tp}" if tp <= kv
             else f"1 per rank at TP {tp}: replicated {tp // kv}x")
    return KVLayout(per_token, 0.0, (
        f"GQA: 2 (K,V) x {kv} KV heads ({split}) x head_dim {hd} x {arch.num_layers} layers "
        f"x {dtype_bytes} B{scales} = {_kib(per_token)}/token per rank",))


def mla(arch: Arch, dtype_bytes: int) -> KVLayout:
    c, src = arch.config, arch.source
    latent = field_of(c, src, "kv_lora_rank") + field_of(c, src, "qk_rope_head_dim")
    per_token = latent * arch.num_layers * dtype_bytes
    return KVLayout(per_token, 0.0, (
        f"MLA latent: (kv_lora_rank {c['kv_lora_rank']} + qk_rope_head_dim "
        f"{c['qk_rope_head_dim']}) x {arch.num_layers} layers x {dtype_bytes} B = "
        f"{_kib(per_token)}/token (replicated on every TP rank)",))


def deepseek_v4(arch: Arch, dtype_bytes: int, packed: bool = False) -> KVLayout:
    """`packed`: vLLM's fp8_ds_mla layout (see the module doc), else `dtype_bytes` per value."""
    c, src = arch.config, arch.source
    hd, idx = field_of(c, src, "head_dim"), field_of(c, src, "index_head_dim")
    window = field_of(c, src, "sliding_window")
    rates = v4_compress_rates(c)
    m_csa, m_hca = rates["compressed_sparse_attention"], rates["heavily_compressed_attention"]
    n = {t: arch.layer_types.count(t) for t in
         ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")}
    if packed:
        entry, key = DS_MLA_ENTRY_BYTES, idx + idx // 128 * 4
        entry_s, key_s = f"{entry} B (fp8_ds_mla)", f"indexer {key} B (fp8 + scales)"
    else:
        entry, key = hd * dtype_bytes, idx * dtype_bytes
        entry_s, key_s = f"head_dim {hd} x {dtype_bytes} B", f"indexer {idx} x {dtype_bytes} B"
    csa = (entry + key) / m_csa
    hca = entry / m_hca
    per_token = n["compressed_sparse_attention"] * csa + n["heavily_compressed_attention"] * hca
    per_seq = arch.num_layers * window * entry
    return KVLayout(per_token, per_seq, (
        f"DeepSeek-V4 ({n['sliding_attention']} sliding-only, {n['compressed_sparse_attention']} "
        f"CSA, {n['heavily_compressed_attention']} HCA layers; one K=V head, replicated on "
        "every TP rank):",
        f"  CSA: ({entry_s} + {key_s}) / {m_csa} = {csa:,.0f} B/token per layer; "
        f"HCA: {entry_s} / {m_hca} = {hca:,.0f} B/token per layer",
        f"  = {_kib(per_token)}/token, plus sliding windows {arch.num_layers} layers x {window} "
        f"x {entry_s} = {per_seq / 2**20:,.1f} MiB per sequence",
    ))


def kv_layout(arch: Arch, tp: int, dtype_bytes: int, cache_dtype: str | None = None,
              scale_bytes: int = 0) -> KVLayout:
    """The KV cost of `arch` per TP rank at tensor-parallel size `tp`.

    `cache_dtype`: vLLM's `kv_cache_dtype` on GPUs (None: plain rows of `dtype_bytes`, as HF and
    vLLM-CPU keep them). DeepSeek-V4 under auto / fp8 / fp8_ds_mla is sized in the packed
    layout; fp8_ds_mla on any other model is a ConfigError. `scale_bytes`: see the module doc
    (GQA models).
    """
    if cache_dtype == "fp8_ds_mla" and arch.model_type != "deepseek_v4":
        raise ConfigError(f"rollout.kv_cache_dtype: 'fp8_ds_mla' is DeepSeek-V4's packed cache "
                          f"layout; model_type {arch.model_type!r} expected auto, bfloat16 or fp8")
    if arch.model_type == "deepseek_v3":
        return mla(arch, dtype_bytes)
    if arch.model_type == "deepseek_v4":
        return deepseek_v4(arch, dtype_bytes, packed=cache_dtype in _DS_MLA_NAMES)
    return gqa(arch, tp, dtype_bytes, scale_bytes)

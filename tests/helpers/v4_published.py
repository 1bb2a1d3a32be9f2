"""A tiny DeepSeek-V4 written in the published checkpoint layout, with reference dequantisation.

Attention / indexer / shared-expert linears as block-FP8 with ue8m0 scales, routed experts as
packed FP4 (MXFP4, ue8m0 per 32 inputs), split over three shards with an index, one scale stored
in another shard than its weight. With `mtp=True` a fourth shard holds an MTP layer in the
published names (`mtp.0.*`, see `mtp_layer`), as the last shard of DeepSeek-V4-Flash does. The
FP4 quantiser and the references here are written independently of `rl.models.convert` and
`rl.quant` (own e2m1 table and bit order, own scale broadcast, own block-FP8 quantiser); the
published FP8 linears are made with `rl.quant.block_fp8` (power-of-two scales), only as input
data.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from rl.quant.block_fp8 import quantize_weight_block

# The linears vLLM's V4 builds with the FP8 quant config (attention.py, nvidia/model.py); the
# compressors, the indexer's weights_proj, routers, embeddings and head get quant_config=None.
FP8_RE = re.compile(r"\.(attn\.(wq_a|wkv|wq_b|wo_a|wo_b)|attn\.indexer\.wq_b|"
                    r"ffn\.shared_experts\.w[123]|[eh]_proj)\.weight$")
FP4_RE = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
FP32_RE = re.compile(r"hc_|attn_sink|\.gate\.bias$")
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
CROSS_SHARD_SCALE = "layers.1.attn.wq_b.scale"
E4M3_MAX = 448.0


def pow2_up(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 0, torch.exp2(torch.ceil(torch.log2(x))), torch.ones_like(x))


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) -> (N, K/2) int8 (code of input 2j in bits 0-3, of 2j+1 in bits 4-7), (N, K/32)
    e8m0 scales."""
    n, k = w.shape
    groups = w.float().reshape(n, k // 32, 32)
    scale = pow2_up(groups.abs().amax(-1) / 6.0)
    v = groups / scale[..., None]
    mag = (v.abs()[..., None] - torch.tensor(E2M1)).abs().argmin(-1)
    codes = (mag | ((v < 0).long() << 3)).reshape(n, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


def ref_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    u = packed.view(torch.uint8).long()
    out = torch.empty(u.shape[0], 2 * u.shape[1])
    for col, codes in ((0, u % 16), (1, u // 16)):
        sign = torch.where(codes >= 8, -1.0, 1.0)
        out[:, col::2] = sign * torch.tensor(E2M1)[codes % 8]
    s = scale.float()
    return out * torch.stack([s] * 32, dim=-1).reshape(out.shape)


def ref_fp8(w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = w8.shape
    s = scale.float()
    rows = torch.arange(n) // 128
    cols = torch.arange(k) // 128
    return w8.float() * s[rows][:, cols]


def ref_block_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) fp32, N and K multiples of 128 -> (e4m3, fp32 (N/128, K/128) scales): one scale
    per 128 x 128 block, the power of two at or above amax / 448 (an all-zero block: 1)."""
    n, k = w.shape
    amax = w.double().reshape(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3))
    scale = pow2_up(amax / E4M3_MAX).float()
    full = scale[torch.arange(n) // 128][:, torch.arange(k) // 128]
    return (w.float() / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def mtp_layer(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """One MTP layer (`mtp.0.*`) in the names of DeepSeek-V4-Flash's published checkpoint and of
    DeepSeek's inference code (`MTPBlock(Block)`): a whole decoder block (attention without
    compressor or indexer, as the published `mtp.0.attn.*` has none; the MoE with its router
    bias; `hc_attn_*` / `hc_ffn_*`), plus `e_proj` / `h_proj` (FP8 linears, hidden -> hidden),
    `enorm` / `hnorm` / `norm` and its own `hc_head_{fn,base,scale}`. No embedding or head: the
    MTP layer shares the main model's. The block's values are the last layer's of `state` (the
    converter only reads names, dtypes and shapes); the rest are drawn from a fixed seed."""
    last = f"layers.{config['num_hidden_layers'] - 1}."
    out = {"mtp.0." + n[len(last):]: t.clone() for n, t in state.items()
           if n.startswith(last) and ".compressor." not in n and ".indexer." not in n}
    g = torch.Generator().manual_seed(0)
    hidden, hc = config["hidden_size"], config["hc_mult"]
    for name in ("e_proj", "h_proj"):
        out[f"mtp.0.{name}.weight"] = torch.randn(hidden, hidden, generator=g) * hidden ** -0.5
    for name in ("enorm", "hnorm", "norm"):
        out[f"mtp.0.{name}.weight"] = torch.ones(hidden)
    out["mtp.0.hc_head_fn"] = torch.randn(hc, hc * hidden, generator=g) * 0.02
    out["mtp.0.hc_head_base"] = torch.zeros(hc)
    out["mtp.0.hc_head_scale"] = torch.ones(1)
    return out


def write_published(state: dict[str, torch.Tensor], config: dict, extras: Path, dst: Path,
                    mtp: bool = False) -> dict[str, torch.Tensor]:
    """Write `state` (checkpoint names) quantised in the published layout into `dst`, with
    `config` plus the published quantization_config and every non-weight file of `extras`
    (tokenizer, generation config); `mtp`: add `mtp_layer(state, config)` in a shard of its own.
    Returns {name: the reference dequantised tensor (fp32) or the original tensor as stored}."""
    if mtp:
        state = {**state, **mtp_layer(state, config)}
    tensors, reference = {}, {}
    for name, t in state.items():
        base = name[:-len(".weight")]
        if FP8_RE.search(name):
            w8, s = quantize_weight_block(t.float(), 128, pow2=True)
            tensors[name], tensors[base + ".scale"] = w8, s.to(torch.float8_e8m0fnu)
            reference[name] = ref_fp8(w8, tensors[base + ".scale"])
        elif FP4_RE.search(name):
            tensors[name], tensors[base + ".scale"] = quantize_fp4(t)
            reference[name] = ref_fp4(tensors[name], tensors[base + ".scale"])
        else:
            keep32 = FP32_RE.search(name) or not t.is_floating_point()
            tensors[name] = t if keep32 else t.to(torch.bfloat16)
            reference[name] = tensors[name]
    dst.mkdir()
    names = sorted(n for n in tensors if not n.startswith("mtp."))
    num_shards = 4 if mtp else 3
    shard = [f"model-{i:05d}-of-{num_shards:05d}.safetensors" for i in range(1, num_shards + 1)]
    weight_map = {}
    for i in range(3):
        weight_map.update({n: shard[i] for n in names[i::3]})
    weight_map.update({n: shard[-1] for n in tensors if n.startswith("mtp.")})
    weight_map[CROSS_SHARD_SCALE] = shard[2]
    weight_map[CROSS_SHARD_SCALE[:-len(".scale")] + ".weight"] = shard[0]
    for fname in sorted(set(weight_map.values())):
        save_file({n: tensors[n].contiguous() for n, f in weight_map.items() if f == fname},
                  str(dst / fname), metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = dict(config)
    config.pop("expert_dtype", None)  # the published Flash config relies on vLLM's default (fp4)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "fmt": "e4m3", "scale_fmt": "ue8m0",
                                     "weight_block_size": [128, 128]}
    (dst / "config.json").write_text(json.dumps(config))
    for extra in extras.iterdir():
        if extra.name not in ("config.json", "model.safetensors"):
            (dst / extra.name).write_bytes(extra.read_bytes())
    return reference



# The published tokenizer's markers: BOS/EOS/pad at ids 0/1/2 (config.json's bos_token_id 0 and
# eos_token_id 1), the role and thinking markers as added tokens. Ids past 2 are this tiny
# vocabulary's own, not the published ones.
V4_SPECIAL = {"<｜begin▁of▁sentence｜>": 0, "<｜end▁of▁sentence｜>": 1, "<｜▁pad▁｜>": 2}
V4_MARKERS = ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>")


def write_published_tokenizer(dst: Path) -> dict[str, int]:
    """Write a tiny tokenizer in the published DeepSeek-V4-Flash layout into `dst` (created if
    missing): `tokenizer.json` (a byte-level BPE, like DeepSeek's, over the 256 byte symbols
    with no merges, plus the markers as added tokens) and a `tokenizer_config.json` naming BOS,
    EOS and pad with no `chat_template` (DeepSeek ships V4's format as code), and the published
    Flash `config.json` (the submit-time data check reads a directory that holds one). Returns
    {marker: id} for the special tokens and markers."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = dict(V4_SPECIAL)
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    for marker in V4_MARKERS:
        vocab[marker] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False) for t in V4_SPECIAL])
    # Like DeepSeek's role and thinking markers: added tokens that decoding keeps.
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in V4_MARKERS])
    dst.mkdir(parents=True, exist_ok=True)
    tok.save(str(dst / "tokenizer.json"))
    bos, eos, pad = V4_SPECIAL
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "add_eos_token": False, "bos_token": bos, "eos_token": eos,
        "pad_token": pad, "clean_up_tokenization_spaces": False, "legacy": True,
        "model_max_length": 1048576, "unk_token": None,
        "tokenizer_class": "TokenizersBackend"}, ensure_ascii=False, indent=2))
    known = Path(__file__).resolve().parents[2] / "rl" / "plan" / "known" / "DeepSeek-V4-Flash.json"
    (dst / "config.json").write_text(known.read_text())
    return {t: vocab[t] for t in (*V4_SPECIAL, *V4_MARKERS)}


def mark_special(tokenizer_dir: Path, *markers: str) -> None:
    """Flag `markers` special in `tokenizer_dir/tokenizer.json` (a `skip_special_tokens` decode
    then drops them): a tokenizer unlike DeepSeek's, for the decode tests."""
    path = tokenizer_dir / "tokenizer.json"
    data = json.loads(path.read_text())
    for token in data["added_tokens"]:
        if token["content"] in markers:
            token["special"] = True
    path.write_text(json.dumps(data, ensure_ascii=False))

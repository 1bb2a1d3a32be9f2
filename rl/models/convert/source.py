"""The published DeepSeek-V4 checkpoint layout: read it (headers only), check it, dequantise it.

Layout (DeepSeek-V4-Flash as published; the same one vLLM 0.32's V4 model loads directly, see
`_make_deepseek_v4_weights_mapper` and `DeepseekV4FP8Config` in vllm/models/deepseek_v4/):
  * sharded safetensors plus `model.safetensors.index.json` (or one `model.safetensors`), in
    DeepSeek's own names (`layers.N.attn.wq_a.weight`, `embed.weight`, `head.weight`, ...);
  * block-FP8 linears (attention wq_a/wkv/wq_b/wo_a/wo_b, the indexer's wq_b, shared experts):
    `X.weight` float8_e4m3fn (N, K) and `X.scale` of shape (ceil(N/b), ceil(K/b)), b from
    config.json `quantization_config.weight_block_size` (128 x 128);
  * FP4 routed experts (`layers.N.ffn.experts.E.w{1,2,3}`): `X.weight` int8 (N, K/2), two e2m1
    values per byte, element 2j in the low nibble; `X.scale` (N, K/32), one scale per 32
    consecutive inputs (MXFP4);
  * scales are ue8m0 (`float8_e8m0fnu`, a bare power of two) in Flash, float32 in Flash-Base;
    both are dequantisation multipliers (`w = q * scale`), which is also `block_fp8`'s convention;
  * everything else (embeddings, head, norms, routers, compressors, mHC, sinks, `tid2eid`) is
    stored unquantised.
The tensor kind is read from the data (a `.weight` with a `.scale` beside it; its dtype says FP8
or FP4), so a checkpoint that quantises a different set of layers converts all the same.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rl.quant.block_fp8 import dequantize_weight_block, num_blocks

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FP4_BLOCK = 32
# e2m1 code -> value; bit 3 is the sign (the OCP MX table, as vLLM and transformers decode it).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_DTYPES = ("F8_E4M3",)
FP4_DTYPES = ("I8", "U8", "F4")
SCALE_DTYPES = ("F8_E8M0", "F32", "U8")
# Safetensors dtypes that only a quantised checkpoint holds (weights or their scales).
QUANTIZED_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "I8", "U8", "F4")


class ConvertError(ValueError):
    """Bad input or output for the converter; reported as one line, exit status 2."""


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (safetensors dtype, shape)} from a .safetensors file's header alone."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, struct.error, ValueError) as e:
        raise ConvertError(f"{path}: not a readable safetensors file ({e})") from None
    header.pop("__metadata__", None)
    return {name: (meta["dtype"], tuple(meta["shape"])) for name, meta in header.items()}


@dataclass(slots=True)
class Source:
    """A checked published checkpoint: where every tensor is and what it is."""
    path: Path
    config: dict
    shards: list[str]
    """Shard file names in index order (sorted)."""
    headers: dict[str, dict[str, tuple[str, tuple[int, ...]]]]
    """{shard: {name: (dtype, shape)}}."""
    weight_map: dict[str, str] = field(default_factory=dict)
    """{tensor name: shard}."""
    block: int = 128
    """FP8 block edge (square blocks)."""

    def kind(self, name: str) -> str:
        """'fp8' / 'fp4' (a quantised weight), 'scale' (its scale) or 'plain'."""
        if name.endswith(".scale") and name[:-len(".scale")] + ".weight" in self.weight_map:
            return "scale"
        dtype = self.headers[self.weight_map[name]][name][0]
        if name.endswith(".weight") and name[:-len(".weight")] + ".scale" in self.weight_map:
            return "fp8" if dtype in FP8_DTYPES else "fp4"
        return "plain"

    def dtype_shape(self, name: str) -> tuple[str, tuple[int, ...]]:
        return self.headers[self.weight_map[name]][name]


def _load_index(path: Path) -> dict[str, str]:
    index_path = path / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConvertError(f"{index_path}: expected JSON with a 'weight_map' ({e})") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConvertError(f"{index_path}: 'weight_map' is empty or not a mapping")
        return weight_map
    if (path / SINGLE_FILE).is_file():
        return {name: SINGLE_FILE for name in read_header(path / SINGLE_FILE)}
    raise ConvertError(f"{path}: no {INDEX_FILE} and no {SINGLE_FILE} (expected the published "
                       "DeepSeek-V4 checkpoint directory)")


def _block_size(path: Path, config: dict) -> int:
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        raise ConvertError(f"{path / 'config.json'}: no quantization_config (expected the "
                           "published FP8/FP4 checkpoint; a BF16 directory needs no conversion)")
    block = qc.get("weight_block_size", [128, 128])
    if (not isinstance(block, list) or len(block) != 2 or block[0] != block[1]
            or not isinstance(block[0], int) or block[0] <= 0):
        raise ConvertError(f"{path / 'config.json'}: quantization_config.weight_block_size: "
                           f"{block!r}, expected [b, b] with b a positive int (128)")
    return block[0]


def _check_pair(src: Source, name: str) -> None:
    """Shape and dtype rules of one quantised weight and its scale (see the module doc)."""
    base = name[:-len(".weight")]
    (wd, (n, *rest)), (sd, s_shape) = src.dtype_shape(name), src.dtype_shape(base + ".scale")
    where = f"{src.path / src.weight_map[name]}: {name}"
    if len(rest) != 1:
        raise ConvertError(f"{where}: shape {(n, *rest)}, expected a 2-D quantised weight")
    if sd not in SCALE_DTYPES:
        raise ConvertError(f"{where}: scale dtype {sd}, expected one of {', '.join(SCALE_DTYPES)}")
    if wd in FP8_DTYPES:
        expected = (num_blocks(n, src.block), num_blocks(rest[0], src.block))
    elif wd in FP4_DTYPES:
        expected = (n, 2 * rest[0] // FP4_BLOCK)
        if (2 * rest[0]) % FP4_BLOCK:
            raise ConvertError(f"{where}: FP4 weight of {2 * rest[0]} inputs, expected a "
                               f"multiple of {FP4_BLOCK}")
    else:
        raise ConvertError(f"{where}: dtype {wd} with a .scale, expected F8_E4M3 (block FP8) "
                           "or I8 (packed FP4)")
    if tuple(s_shape) != expected:
        raise ConvertError(f"{where}: scale shape {tuple(s_shape)}, expected {expected} for a "
                           f"{wd} weight of shape {(n, *rest)}")


def open_source(path: str | Path) -> Source:
    """Read and check the checkpoint at `path` (config, index, every shard's header).

    Raises ConvertError naming the file (and tensor) for anything outside the published layout:
    a missing shard, a tensor the index and the shard disagree on, a scale without a weight, a
    quantised weight without a scale, or a scale whose shape does not fit its weight.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConvertError(f"{path}: no config.json (expected the published DeepSeek-V4 "
                           "checkpoint directory)")
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError as e:
        raise ConvertError(f"{path / 'config.json'}: invalid JSON ({e})") from None
    if config.get("model_type") != "deepseek_v4":
        raise ConvertError(f"{path / 'config.json'}: model_type {config.get('model_type')!r}, "
                           "expected 'deepseek_v4'")
    weight_map = _load_index(path)
    shards = sorted(set(weight_map.values()))
    headers = {}
    for shard in shards:
        if not (path / shard).is_file():
            raise ConvertError(f"{path / INDEX_FILE}: shard {shard} is missing")
        headers[shard] = read_header(path / shard)
    for name, shard in weight_map.items():
        if name not in headers[shard]:
            raise ConvertError(f"{path / shard}: has no tensor {name} (the index says it does)")
    src = Source(path, config, shards, headers, weight_map, _block_size(path, config))
    for name in weight_map:
        if name.endswith(".scale") and name[:-len(".scale")] + ".weight" not in weight_map:
            raise ConvertError(f"{path / weight_map[name]}: {name} has no weight "
                               f"{name[:-len('.scale')]}.weight")
        kind = src.kind(name)
        if kind in ("fp8", "fp4"):
            _check_pair(src, name)
        elif kind == "plain" and src.dtype_shape(name)[0] in QUANTIZED_DTYPES:
            raise ConvertError(f"{path / weight_map[name]}: {name} is {src.dtype_shape(name)[0]} "
                               "without a .scale beside it")
    return src


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """fp32 multipliers from ue8m0 (float8_e8m0fnu, or its raw uint8 exponent byte) or fp32."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def _byte_table() -> torch.Tensor:
    """(256, 2) fp32: the two e2m1 values of every byte, low nibble first."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.arange(256)
    return torch.stack([lut[codes & 0xF], lut[codes >> 4]], dim=-1)


_FP4_PAIRS = _byte_table()


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """(..., K/2) int8 / uint8, two e2m1 codes per byte (low nibble first) -> (..., K) fp32."""
    # One row lookup per byte (`embedding`): ~4x faster on CPU than decoding the two nibbles
    # separately, which matters for the ~33k expert tensors of the published Flash checkpoint.
    u8 = packed.contiguous().view(torch.uint8)
    pairs = torch.nn.functional.embedding(u8.int(), _FP4_PAIRS)
    return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(N, K/2) packed e2m1 with (N, K/32) scales -> (N, K) `dtype`."""
    *lead, half = packed.shape
    groups = unpack_fp4(packed).view(*lead, 2 * half // FP4_BLOCK, FP4_BLOCK)
    return (groups * scale_to_float(scale)[..., None]).view(*lead, 2 * half).to(dtype)


def dequantize(kind: str, weight: torch.Tensor, scale: torch.Tensor, block: int,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A quantised weight ('fp8' or 'fp4') as `dtype`. With ue8m0 scales the BF16 result is
    exact: an e4m3 or e2m1 value times a power of two fits BF16's 8-bit mantissa."""
    if kind == "fp4":
        return dequantize_fp4(weight, scale, dtype)
    return dequantize_weight_block(weight, scale_to_float(scale), block, dtype)

"""Shard-by-shard, resumable, checksummed conversion of a checked `Source` into a directory.

Targets:
  * `trainer`: BF16 for DeepSpeed. Every FP8 / FP4 weight is dequantised to BF16 (exact with
    ue8m0 scales) and its `.scale` dropped; other tensors keep their dtype (fp32 mHC, sinks and
    router biases stay fp32). Names stay DeepSeek's, which `load_model` (transformers 5.19)
    reads, the same form `presets.save_model` writes. config.json loses `quantization_config`,
    gains `expert_dtype: bf16`.
  * `rollout`: a layout vLLM 0.32's V4 FP8 model (`DeepseekV4FP8Config`) loads, in one of two
    expert forms (`ROLLOUT_EXPERTS`):
    - `fp8` (what the weight sync needs): the FP4 routed experts requantised to block FP8 in
      the sync wire's layout (`X.weight` e4m3 + `X.scale` fp32, one scale per 128 x 128 block),
      vLLM's `expert_dtype: fp8` layout (Fp8MoEMethod's `w13/w2_weight_scale_inv`), losslessly
      (see `fp4_as_block_fp8`). The FP8 linears keep their bytes; their ue8m0 scales become
      fp32 (exact), the dtype vLLM allocates when the experts are FP8.
    - `fp4`: every tensor copied unchanged (MXFP4 experts, `expert_dtype: fp4`), which an engine
      fed by the weight sync cannot use (the wire carries FP8 experts).

The MTP layer (`mtp.*`, ~13 GB in BF16 at Flash scale) is kept only by the `fp4` rollout form
(`keeps_mtp`). The trainer does not train it (transformers' V4 has no MTP module and ignores the
names). vLLM's V4 model drops `mtp.*` unless speculative decoding is configured, which the
rollout engine does not do, and the weight sync never sends MTP: in a weight-synced engine it
would draft for the pre-RL policy after the first sync. The `fp4` copy, which no sync changes,
keeps it for a standalone engine that may use it as a speculative draft. An input shard holding
only MTP tensors (the published Flash's last shard) produces no output file.

Resumability: output shards are written to a temporary name and renamed; after all parts of an
input shard are in place, `convert_manifest.json` (also replaced atomically) records their
sha256. A rerun checks the manifest's source fingerprint, re-hashes every recorded file, skips
input shards whose outputs match, and converts the others again (a corrupt or missing output is
reported on its own line). Peak memory: one input shard's tensors (read one at a time through
safetensors' memory map) plus one output part of at most `max_shard_bytes`.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rl.models.convert.source import INDEX_FILE, ConvertError, Source, dequantize, scale_to_float
from rl.quant.block_fp8 import DEFAULT_BLOCK, quantize_weight_block

TARGETS = ("trainer", "rollout")
ROLLOUT_EXPERTS = ("fp8", "fp4")
MANIFEST = "convert_manifest.json"
# 2: the trainer and the fp8 rollout form leave the MTP layer out (1 wrote its quantised
# tensors into both); a directory written by 1 is refused rather than resumed half one, half two.
FORMAT_VERSION = 2
MTP_PREFIX = "mtp."
_SKIP_FILES = {INDEX_FILE, "config.json", MANIFEST}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _fingerprint(src: Source, target: str, experts: str) -> dict:
    """What the outputs were made from: the index and every header (cheap, and changes with any
    shard's layout), plus the target (and the rollout's expert form) and the format version."""
    h = hashlib.sha256(json.dumps(src.headers, sort_keys=True).encode())
    h.update(json.dumps(src.weight_map, sort_keys=True).encode())
    fingerprint = {"source": str(src.path.resolve()), "layout_sha256": h.hexdigest(),
                   "target": target, "format_version": FORMAT_VERSION}
    if target == "rollout":
        fingerprint["experts"] = experts
    return fingerprint


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


class ShardReader:
    """Tensors by name across shards (memory-mapped; one tensor is materialised at a time)."""

    def __init__(self, src: Source):
        self.src, self._open = src, {}  # type: ignore[var-annotated]  # lint baseline (issue 39)

    def get(self, name: str) -> torch.Tensor:
        shard = self.src.weight_map[name]
        if shard not in self._open:
            self._open[shard] = safe_open(str(self.src.path / shard), framework="pt")
        return self._open[shard].get_tensor(name)

    def close(self) -> None:
        """Drop the memory maps (between input shards: pages of finished shards are let go)."""
        self._open = {}


def fp4_as_block_fp8(weight: torch.Tensor, scale: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 expert (packed e2m1 + ue8m0 per 32 inputs) -> (e4m3 (N, K), fp32 128 x 128 block
    scales), the layout the sync's wire sends.

    The block scales are powers of two (2^ceil(log2(amax / 448))), so every e2m1 value (at most
    two significant bits) times its power-of-two FP4 scale is exactly an e4m3 value times the
    block scale: the engine starts from the published experts without loss, unless the FP4
    scales within one 128 x 128 block span more than about 2^12 (then that block's smallest
    values round in e4m3). The wire's own scales (amax / 448) would round most values once more;
    the loop's first sync replaces these weights anyway, so only a standalone engine sees them.
    """
    return quantize_weight_block(dequantize("fp4", weight, scale, DEFAULT_BLOCK, torch.float32),
                                 DEFAULT_BLOCK, pow2=True)


def keeps_mtp(target: str, experts: str) -> bool:
    """Whether the output keeps the MTP layer (`mtp.*`): only the unchanged fp4 rollout copy."""
    return target == "rollout" and experts == "fp4"


def _rollout_tensors(src: Source, reader: ShardReader, name: str, experts: str):
    """The rollout outputs of input tensor `name` (see the module doc)."""
    if experts == "fp4":
        yield name, reader.get(name)
        return
    kind = src.kind(name)
    base = name[:-len(".scale")] if kind == "scale" else name[:-len(".weight")]
    if kind == "fp4":
        w8, scale = fp4_as_block_fp8(reader.get(name), reader.get(base + ".scale"))
        yield name, w8
        yield base + ".scale", scale
    elif kind == "scale" and src.kind(base + ".weight") == "fp8":
        yield name, scale_to_float(reader.get(name))
    elif kind != "scale":  # an FP4 weight's scale is written with its weight, above
        yield name, reader.get(name)


def _output_tensors(src: Source, reader: ShardReader, shard: str, target: str, experts: str):
    """(name, tensor) pairs for the outputs of input `shard`, one at a time, in name order."""
    mtp = keeps_mtp(target, experts)
    for name in sorted(src.headers[shard]):
        if name.startswith(MTP_PREFIX) and not mtp:
            continue
        kind = src.kind(name)
        if target == "rollout":
            yield from _rollout_tensors(src, reader, name, experts)
        elif kind in ("fp8", "fp4"):
            base = name[:-len(".weight")]
            yield name, dequantize(kind, reader.get(name), reader.get(base + ".scale"), src.block)
        elif kind == "plain":
            yield name, reader.get(name)


def _save_part(tensors: dict[str, torch.Tensor], out_dir: Path, fname: str) -> str:
    tmp = out_dir / f".{fname}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    digest = sha256_file(tmp)
    os.replace(tmp, out_dir / fname)
    return digest


def _convert_shard(src: Source, reader: ShardReader, shard_no: int, shard: str, target: str,
                   experts: str, out_dir: Path, max_shard_bytes: int) -> dict:
    """Write the parts of one input shard; returns its manifest entry (no files when the
    target keeps none of its tensors)."""
    files: dict[str, dict] = {}
    part: dict[str, torch.Tensor] = {}
    size = 0
    weight_map: dict[str, str] = {}

    def flush():
        nonlocal part, size
        fname = f"model-{shard_no:05d}-{len(files) + 1:03d}.safetensors"
        files[fname] = _save_part(part, out_dir, fname)
        weight_map.update({n: fname for n in part})
        part, size = {}, 0

    for name, tensor in _output_tensors(src, reader, shard, target, experts):
        nbytes = tensor.numel() * tensor.element_size()
        if part and size + nbytes > max_shard_bytes:
            flush()
        part[name], size = tensor.contiguous(), size + nbytes
    if part:
        flush()
    return {"files": files, "weight_map": weight_map}


def _verified(out_dir: Path, entry: dict, log: Callable[[str], None]) -> bool:
    for fname, digest in entry["files"].items():
        path = out_dir / fname
        if not path.is_file():
            log(f"  {fname}: missing, converting its input shard again")
            return False
        actual = sha256_file(path)
        if actual != digest:
            log(f"  {fname}: checksum mismatch (manifest {digest[:12]}, file {actual[:12]}), "
                "converting its input shard again")
            return False
    return True


def _output_config(src: Source, target: str, experts: str) -> dict:
    config = dict(src.config)
    if target == "trainer":
        config.pop("quantization_config", None)
        config["expert_dtype"] = "bf16"
        config["torch_dtype"] = "bfloat16"
    elif experts == "fp8":
        # vLLM's DeepseekV4FP8Config: FP8 experts, fp32 linear scales (`is_scale_e8m0` off).
        # `scale_fmt: ue8m0` would switch DeepGEMM to ue8m0 scales, which the sync's fp32
        # amax / 448 scales are not.
        config["expert_dtype"] = "fp8"
        config["quantization_config"] = {k: v for k, v in config["quantization_config"].items()
                                         if k != "scale_fmt"}
    else:
        # vLLM's default is fp4 too; written out so the directory says what it holds.
        config.setdefault("expert_dtype", "fp4")
    return config


def _finish(src: Source, out_dir: Path, target: str, experts: str, manifest: dict) -> int:
    """Index, config and the source's other files (tokenizer, generation config); total bytes."""
    weight_map, total = {}, 0
    for entry in manifest["shards"].values():
        weight_map.update(entry["weight_map"])
        total += sum((out_dir / f).stat().st_size for f in entry["files"])
    _write_json_atomic(out_dir / INDEX_FILE, {"metadata": {"total_size": total},
                                              "weight_map": dict(sorted(weight_map.items()))})
    _write_json_atomic(out_dir / "config.json", _output_config(src, target, experts))
    for item in sorted(src.path.iterdir()):
        # Not weights: tokenizer, generation config, license, the model card.
        if (item.is_file() and item.name not in _SKIP_FILES and item.suffix != ".safetensors"
                and not item.name.startswith(".")):
            shutil.copyfile(item, out_dir / item.name)
    return total


def convert(src: Source, out_dir: str | Path, target: str, *, rollout_experts: str = "fp8",
            max_shard_bytes: int = 5 << 30, log: Callable[[str], None] = print,
            on_shard_done: Callable[[str], None] | None = None) -> dict:
    """Convert `src` into `out_dir` for `target` ('trainer' or 'rollout'); returns the manifest.

    `rollout_experts` ('fp8' or 'fp4'): the routed experts' form on the rollout side. Prints one
    line per input shard. `on_shard_done(shard)` runs after each shard's manifest entry is saved
    (tests interrupt the conversion there).
    """
    if target not in TARGETS:
        raise ConvertError(f"target {target!r}, expected one of {', '.join(TARGETS)}")
    if rollout_experts not in ROLLOUT_EXPERTS:
        raise ConvertError(f"rollout experts {rollout_experts!r}, expected one of "
                           f"{', '.join(ROLLOUT_EXPERTS)}")
    out_dir = Path(out_dir)
    if out_dir.resolve() == src.path.resolve():
        raise ConvertError(f"{out_dir}: the output directory is the source directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    fingerprint = _fingerprint(src, target, rollout_experts)
    manifest_path = out_dir / MANIFEST
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        recorded = manifest.get("fingerprint") or {}
        if recorded.get("format_version") != FORMAT_VERSION:
            raise ConvertError(f"{manifest_path}: written by another converter version (format "
                               f"{recorded.get('format_version')}, this one writes "
                               f"{FORMAT_VERSION}); convert into an empty directory")
        if recorded != fingerprint:
            raise ConvertError(f"{manifest_path}: records a conversion of another source or "
                               f"target ({manifest.get('fingerprint')}); use an empty directory")
    elif any(out_dir.iterdir()):
        raise ConvertError(f"{out_dir}: not empty and has no {MANIFEST}; expected an empty or "
                           "a partly converted directory")
    else:
        manifest = {"fingerprint": fingerprint, "shards": {}}
    for stale in out_dir.glob(".*.tmp"):  # an interrupted write
        stale.unlink()
    reader = ShardReader(src)
    n = len(src.shards)
    for i, shard in enumerate(src.shards, start=1):
        entry = manifest["shards"].get(shard)
        if entry is not None and _verified(out_dir, entry, log):
            log(f"[{i}/{n}] {shard}: converted earlier, sha256 verified")
            continue
        t0 = time.monotonic()
        entry = _convert_shard(src, reader, i, shard, target, rollout_experts, out_dir,
                               max_shard_bytes)
        manifest["shards"][shard] = entry
        _write_json_atomic(manifest_path, manifest)
        reader.close()
        size = sum((out_dir / f).stat().st_size for f in entry["files"]) / 2**30
        parts = ", ".join(entry["files"]) or f"nothing (no tensors for the {target})"
        log(f"[{i}/{n}] {shard} -> {parts} ({size:.3f} GiB, {time.monotonic() - t0:.1f} s)")
        if on_shard_done is not None:
            on_shard_done(shard)
    total = _finish(src, out_dir, target, rollout_experts, manifest)
    log(f"{target}: {out_dir} complete, {n} input shards, {total / 2**30:.3f} GiB")
    return manifest

"""A trained DeepSeek-V4 out of its checkpoint in the layout DeepSeek publishes
(`python -m launch.export RUN_DIR --format deepseek-v4`, docs/export.md).

The inverse of `launch.convert --trainer-out`: the trainer's tensors (read as `export_hf` reads
them, `rl.export.model_tensors`) in DeepSeek's names, each quantised or cast back to the form the
published checkpoint stores it in (`rl.models.convert.layout`): block-FP8 linears and FP4 routed
experts (or FP8 ones, `experts="fp8"`) with power-of-two scales, from their BF16 values
(`rl.models.convert.quantize`, DeepSeek's own rounding). Sharded safetensors, always with
`model.safetensors.index.json`, plus the published config.json and tokenizer files, which
`launch.convert` reads again. One tensor is held at a time, plus the shard being filled.

The published checkpoint (`published`, default: the one `launch.convert` recorded in the model
directory's convert_manifest.json) gives the layout, config and tokenizer files, and the MTP
layer (`mtp.*`), which the trainer does not train: it is copied through unchanged (`mtp`), so
the export serves like the original, speculative decoding included; the MTP layer then drafts
for the pre-RL policy (drafts are verified, so only their acceptance rate can drop). Without
the published checkpoint the layout follows DeepSeek-V4-Flash's by name, config.json is the
run's own plus DeepSeek's quantization_config, and there is no MTP layer to copy.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from rl.export import ExportError, ShardWriter, copy_model_files, model_tensors
from rl.models.convert.layout import Layout, LayoutError
from rl.models.convert.source import ConvertError, Source, open_source, read_header
from rl.models.convert.writer import MANIFEST, MTP_PREFIX, ShardReader

FORMAT = "deepseek-v4"


def published_source(model_dir: Path, published: Path | None,
                     say: Callable[[str], None]) -> Source | None:
    """The published checkpoint: `published`, else the source `launch.convert` recorded in
    `model_dir`/convert_manifest.json when it is still there (None, said, when it is not)."""
    if published is None:
        manifest = Path(model_dir) / MANIFEST
        if not manifest.is_file():
            say(f"export: {model_dir} was not written by launch.convert (no {MANIFEST}): "
                "DeepSeek-V4-Flash's layout by name, no MTP layer")
            return None
        try:
            published = Path(json.loads(manifest.read_text())["fingerprint"]["source"])
        except (ValueError, KeyError, TypeError):
            raise ExportError(f"{manifest}: no fingerprint.source (the published checkpoint "
                              "it was converted from); pass --published DIR") from None
        if not (published / "config.json").is_file():
            say(f"export: {published}, which {model_dir} was converted from, is gone: "
                "DeepSeek-V4-Flash's layout by name, no MTP layer (pass --published DIR)")
            return None
    try:
        return open_source(published)
    except ConvertError as e:
        raise ExportError(f"--published: {e}") from None


def _check_layout(out: Path, shards: list[str], source: Source, mtp: bool) -> int:
    """The output's names, dtypes and shapes equal `source`'s (less MTP when it was left out);
    returns the number of tensors."""
    written: dict = {}
    for shard in shards:
        written.update(read_header(out / shard))
    want = {n: source.dtype_shape(n) for n in source.weight_map
            if mtp or not n.startswith(MTP_PREFIX)}
    for name in sorted(set(want) | set(written)):
        if written.get(name) != want.get(name):
            raise ExportError(f"{out}: {name} is {written.get(name)} (dtype, shape), the "
                              f"published {source.path} has {want.get(name)}")
    return len(written)


def _write_tensors(checkpoint: Path, model, layout: Layout, writer: ShardWriter,
                   stats: dict) -> None:
    seen = set()
    try:
        for name, t in model_tensors(checkpoint, model, lambda n, t: t, stats):
            for out_name, out_t in layout.tensors(name, t):
                writer.add(out_name, out_t)
            seen.add(name)
    except LayoutError as e:
        raise ExportError(f"{checkpoint}: {e}") from None
    if missing := sorted(layout.expected() - seen):
        assert layout.source is not None  # only a source expects names
        raise ExportError(f"{checkpoint}: no tensor for {missing[0]} (and {len(missing) - 1} "
                          f"more) of the published checkpoint {layout.source.path}")


def _copy_mtp(layout: Layout, writer: ShardWriter) -> int:
    """The published MTP layer, unchanged, in shards of its own (as DeepSeek ships it)."""
    names = layout.mtp_names()
    if names:
        writer.flush()
        assert layout.source is not None  # only a source has MTP names
        reader = ShardReader(layout.source)
        for name in names:
            writer.add(name, reader.get(name))
        reader.close()
    return len(names)


def export_deepseek_v4(checkpoint: Path, model_dir: Path, out: Path, experts: str | None = None,
                       published: Path | None = None, mtp: bool = True,
                       max_shard_bytes: int = 5 * 2**30,
                       say: Callable[[str], None] = print) -> dict:
    """Write checkpoint `checkpoint`'s actor (a DeepSeek-V4 run started from `model_dir`) into
    `out` (prepared by `prepare_out`) in the published layout; `experts`: 'fp4' or 'fp8'
    (default: the published checkpoint's form, else fp4); `mtp`: copy the published MTP layer.
    Returns the record also written to `out/export.json`."""
    from rl.export import _meta_model
    checkpoint, model_dir, out = Path(checkpoint), Path(model_dir), Path(out)
    t0 = time.perf_counter()
    model = _meta_model(model_dir)
    if model.config.model_type != "deepseek_v4":
        raise ExportError(f"{model_dir}: model_type {model.config.model_type!r}; --format "
                          f"{FORMAT} writes DeepSeek-V4 only (use --format hf)")
    source = published_source(model_dir, published, say)
    try:
        layout = Layout(source, experts)
    except LayoutError as e:
        raise ExportError(str(e)) from None
    where = f"the published {source.path}" if source is not None else "DeepSeek-V4-Flash's names"
    say(f"export: layout of {where}, routed experts {layout.experts}")
    writer = ShardWriter(out, max_shard_bytes, say, always_index=True)
    stats: dict = {}
    _write_tensors(checkpoint, model, layout, writer, stats)
    copied = _copy_mtp(layout, writer) if mtp else 0
    if source is not None and layout.mtp_names():
        say(f"export: MTP layer: {copied} tensors copied unchanged from {source.path}"
            if copied else "export: MTP layer left out (--no-mtp)")
    shards = writer.finish()
    base = json.loads((model_dir / "config.json").read_text())
    # the tokenizer and generation config DeepSeek ships, else the run's
    copy_model_files(source.path if source is not None else model_dir, out, layout.config(base))
    record = {"format": FORMAT, "checkpoint": str(checkpoint.resolve()),
              "model_dir": str(model_dir), "published": str(source.path) if source else None,
              "experts": layout.experts, "mtp_tensors": copied, "shards": shards,
              "bytes": writer.total_bytes, "seconds": round(time.perf_counter() - t0, 3),
              **stats, "largest_shard_bytes": writer.peak_bytes}
    if layout.as_source and source is not None:
        record["tensors"] = _check_layout(out, shards, source, bool(copied))
        say(f"export: {record['tensors']} tensors, names, dtypes and shapes as in {source.path}")
    (out / "export.json").write_text(json.dumps(record, indent=2) + "\n")
    return record

"""A run's trained actor out of its checkpoint, as a Hugging Face model directory
(`python -m launch.export`, docs/export.md).

Reads one checkpoint (`rl.checkpoint` layout) offline, in one CPU process, and writes the actor in
the checkpoint names `rl.models.name_maps.to_engine_weights` gives (what `presets.save_model`
writes, what transformers and vLLM load), sharded safetensors with `model.safetensors.index.json`,
plus the run's model directory's config, tokenizer and generation config. The `deepseek-v4`
format (`rl.export_deepseek`) reads the same tensor stream (`model_tensors`) and writes it in
DeepSeek's published FP8/FP4 layout.

Where the tensors come from (`trainer_tensors`, in HF in-memory names):
  * ZeRO 0-2: rank 0's `mp_rank_00_model_states.pt` holds the whole module in the training dtype
    (exactly the weights the trainer ran with), buffers included.
  * ZeRO-3: each rank's `zero_pp_rank_R_mp_rank_00_optim_states.pt` holds its fp32 partitions of
    every parameter (`fp32_flat_groups`); a parameter is its ranks' slices put end to end
    (DeepSpeed's `zero_to_fp32` layout). The trainer's BF16 weights are these masters rounded
    (its optimizer step copies them in), so the BF16 export is bit for bit the same; in a BF16
    run that holds for the parameters the model keeps in fp32 too (DeepSpeed stores their
    partitions in its BF16 flat buffer: they are written as fp32 holding BF16 values). Buffers
    (`tid2eid`, `e_score_correction_bias`) come from rank 0's model-states file.
  * Expert parallelism: routed experts live outside DeepSpeed in `experts_rank_R.pt`, each rank's
    fp32 master slice of every `experts.gate_up_proj` / `down_proj`; the first EP group's ranks
    hold one of each slice.

Memory: every file is opened with `torch.load(mmap=True)`, so a tensor is read from disk when it
is used. The process holds one full tensor (fp32 under ZeRO-3 and EP: 2 bytes more per element
than the BF16 output) plus the output shard being filled (at most `max_shard_bytes`, or one tensor
when a single one is larger); the page cache holds what was read. ZeRO-3's optimizer files also
hold the Adam moments: they are mapped, never read.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from rl.checkpoint import CheckpointManager
from rl.checkpoint_files import sha256_files
from rl.config import ConfigError

log = logging.getLogger(__name__)

FORMATS = ("hf", "deepseek-v4")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
INDEX_FILE = "model.safetensors.index.json"
FINAL_EXPORT = "export/hf"
"""Where `checkpoint.export_final` writes, relative to the run directory."""
DEFAULT_SHARD_BYTES = 5 * 2**30
# Model-directory files that are not weights: copied as they are (config.json is rewritten).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
_SKIP_FILES = {INDEX_FILE, "sft.json", "convert_manifest.json", "export.json"}


class ExportError(ConfigError):
    """The run, its checkpoint or the output directory does not allow the export (exit 2)."""


# ---- which checkpoint ------------------------------------------------------------------------
def find_checkpoint(run_dir: Path, step: int | None = None, verify: bool = True
                    ) -> tuple[Path, dict]:
    """(checkpoint directory, manifest): the newest intact checkpoint of `run_dir`, or step
    `step`'s. `verify`: also check the files' SHA-256 against the manifest (one read of the
    checkpoint); sizes are always checked. Nothing is moved or deleted (unlike a resume)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory")
    if not (run_dir / "checkpoints").is_dir():
        raise ExportError(f"{run_dir}: no checkpoints directory (not a run directory, or the run "
                          "wrote no checkpoint yet)")
    manager = CheckpointManager(run_dir, create=False)
    digests = (lambda path, files: sha256_files(path, list(files))) if verify else None
    dirs = manager.step_dirs()
    if step is not None:
        found = [d for d in dirs if d.name == f"step_{step:06d}"]
        if not found:
            have = ", ".join(str(s) for s in sorted(manager.complete_steps())) or "none"
            raise ExportError(f"{run_dir}: no checkpoint of step {step} (checkpoints: {have})")
        dirs = found
    skipped = []
    for d in dirs:
        manifest, why = manager.check(d, digests)
        if why is None:
            assert manifest is not None  # `check` gives one of the two
            return d, manifest
        log.warning("skipping checkpoint %s: %s", d.name, why)
        skipped.append(f"{d.name}: {why}")
    if not skipped:
        raise ExportError(f"{run_dir}: no checkpoint")
    raise ExportError(f"{run_dir}: no intact checkpoint ({'; '.join(skipped)})")


def run_model_dir(run_dir: Path) -> Path | None:
    """The model directory the run started from (its config and tokenizer), from
    RUN_DIR/config.yaml (`rl.sft.find_run_model_dir`): the first candidate that holds a
    config.json, None when config.yaml is missing or names nothing that exists."""
    from rl.sft import find_run_model_dir
    return find_run_model_dir(run_dir, holds="config.json")[1]


# ---- the trainer's tensors -------------------------------------------------------------------
def _load(path: Path):
    from rl import safe_load
    return safe_load.load(path, map_location="cpu", mmap=True)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _rounded(read: Callable[[], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return read().to(dtype)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts)


def trainer_tensors(trainer_dir: Path, tag: str = "ds"
                    ) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(HF in-memory name, a function that reads the whole tensor) for every parameter,
    persistent buffer and expert-parallel shard of the checkpoint's `trainer/` directory, in the
    module's order; the experts last. Nothing is read until a function is called."""
    ds = Path(trainer_dir) / tag
    if (ds / "mp_rank_00_model_states.pt").is_file():  # ZeRO 0-2: the whole module
        module = _load(ds / "mp_rank_00_model_states.pt")["module"]
        for name, t in module.items():
            yield name, functools.partial(_same, t)
    elif (ds / "zero_pp_rank_0_mp_rank_00_model_states.pt").is_file():
        yield from _zero3_tensors(ds)
    else:
        raise ExportError(f"{ds}: neither mp_rank_00_model_states.pt (ZeRO 0-2) nor "
                          "zero_pp_rank_0_mp_rank_00_model_states.pt (ZeRO-3): not a DeepSpeed "
                          "checkpoint this version wrote")
    yield from _expert_tensors(ds)


def _zero3_tensors(ds: Path) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    from deepspeed.utils.zero_to_fp32 import GatheredTensor, zero3_partitioned_param_info
    state = _load(ds / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    shapes = {k: v for group in state["param_shapes"] for k, v in group.items()}
    if state.get("frozen_param_shapes"):
        raise ExportError(f"{ds}: frozen parameters under ZeRO-3 are not supported by the export")
    # `bf16_zero_pp_rank_R_...` when the run trained in BF16
    files = sorted(ds.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt"),
                   key=lambda p: int(p.name.split("zero_pp_rank_")[1].split("_")[0]))
    if not files:
        raise ExportError(f"{ds}: no ZeRO-3 optimizer shards (*zero_pp_rank_*_optim_states.pt)")
    optim = [_load(f)["optimizer_state_dict"] for f in files]
    world = optim[0]["partition_count"]
    world = max(world) if isinstance(world, list) else world
    if world != len(files):
        raise ExportError(f"{ds}: {len(files)} optimizer shards, the checkpoint was written by "
                          f"{world} ranks")
    groups = [o["fp32_flat_groups"] for o in optim]
    bounds = [0]
    for flat in groups[0]:
        bounds.append(bounds[-1] + flat.numel())
    shared = dict(state.get("shared_params", {}))
    buffers = {k: v for k, v in state["module"].items() if k not in shapes and k not in shared}
    # A BF16 run keeps every parameter's partition in one BF16 flat buffer (DeepSpeed's
    # `defragment`), also those the model keeps in fp32 (V4's norms and mixers): the weights the
    # trainer runs with are the masters rounded to BF16, whatever the parameter's dtype.
    low = torch.bfloat16 if files[0].name.startswith("bf16_") else None
    offset, lazies = 0, {}
    for name, shape in shapes.items():
        part, _ = zero3_partitioned_param_info(shape.numel(), world)
        lazy = GatheredTensor(groups, bounds, offset, part, shape)
        lazies[name] = (lazy.contiguous if low is None
                        else functools.partial(_rounded, lazy.contiguous, low))
        offset += part
    if offset != bounds[-1]:
        raise ExportError(f"{ds}: the parameters take {offset} elements a rank, its partitions "
                          f"hold {bounds[-1]}")
    yield from lazies.items()
    for name, t in buffers.items():
        yield name, functools.partial(_same, t)
    for alias, target in shared.items():  # tied weights: the tensor they share
        yield alias, lazies[target]


def _expert_tensors(ds: Path) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """The routed experts of an expert-parallel run: each full (E, ...) tensor from the fp32
    master slices of the first EP group's ranks (one file each)."""
    first = ds / "experts_rank_00000.pt"
    if not first.is_file():
        return
    head = _load(first)
    ep_size = head["ep_size"]
    shards = [head] + [_load(ds / f"experts_rank_{r:05d}.pt") for r in range(1, ep_size)]
    for r, s in enumerate(shards):
        if s["ep_rank"] != r or s["ep_size"] != ep_size:
            raise ExportError(f"{ds}: experts_rank_{r:05d}.pt holds shard {s['ep_rank']} of "
                              f"{s['ep_size']}, expected {r} of {ep_size}")
    for name in head["master"]:
        yield name, functools.partial(_cat, [s["master"][name] for s in shards])


# ---- writing ---------------------------------------------------------------------------------
def _meta_model(model_dir: Path):
    from rl.models.hf_classes import transformers_classes
    from rl.models.loading import model_type
    config_cls, model_cls = transformers_classes(model_type(model_dir))
    config = config_cls.from_pretrained(str(model_dir), local_files_only=True)
    with torch.device("meta"):
        return model_cls._from_config(config)


def _dtype_rule(model, dtype: torch.dtype) -> Callable[[str, torch.Tensor], torch.dtype]:
    """The dtype each tensor is written in: what `from_pretrained(dtype=dtype)` gives it (the
    architecture's fp32-kept modules stay fp32: V4's norms, mixers, sinks, router biases);
    integer tensors (`tid2eid`) keep theirs."""
    plan = model._get_dtype_plan(dtype)
    if plan:
        from transformers.core_model_loading import build_glob_alternation
        keep, _, _ = build_glob_alternation(list(plan))

    def rule(name: str, t: torch.Tensor) -> torch.dtype:
        if not t.dtype.is_floating_point:
            return t.dtype
        return torch.float32 if plan and keep.search(name) else dtype
    return rule


class ShardWriter:
    """Tensors into `model-NNNNN.safetensors` files of at most `max_bytes` (a larger tensor gets
    a file of its own), renamed `-of-TOTAL` and indexed at `finish`; a single file becomes
    `model.safetensors` without an index, unless `always_index`."""

    def __init__(self, out: Path, max_bytes: int, say: Callable[[str], None],
                 always_index: bool = False):
        self.out, self.max_bytes, self.say = out, max_bytes, say
        self.always_index = always_index
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0
        self.peak_bytes = 0
        self.t0 = time.perf_counter()

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = t
        self.pending_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.pending_bytes)

    def flush(self) -> None:
        if not self.pending:
            return
        from safetensors.torch import save_file
        path = self.out / f"model-{len(self.files) + 1:05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.pending)))
        self.total_bytes += self.pending_bytes
        self.say(f"export: wrote {path.name}: {len(self.pending)} tensors, "
                 f"{self.pending_bytes / 2**20:.1f} MiB ({self.total_bytes / 2**30:.2f} GiB in "
                 f"{time.perf_counter() - self.t0:.1f}s)")
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[str]:
        self.flush()
        if len(self.files) == 1 and not self.always_index:
            path, _ = self.files[0]
            path.rename(self.out / "model.safetensors")
            return ["model.safetensors"]
        weight_map, names = {}, []
        for i, (path, tensors) in enumerate(self.files, 1):
            final = f"model-{i:05d}-of-{len(self.files):05d}.safetensors"
            path.rename(self.out / final)
            names.append(final)
            weight_map.update(dict.fromkeys(tensors, final))
        index = {"metadata": {"total_size": self.total_bytes},
                 "weight_map": dict(sorted(weight_map.items()))}
        (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return names


def prepare_out(out: Path, force: bool) -> None:
    """`out` must be missing or empty; with `force` an existing one is emptied."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ExportError(f"--out {out}: not empty (pass --force to replace what is there)")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def model_tensors(checkpoint: Path, model, cast: Callable[[str, torch.Tensor], torch.Tensor],
                  stats: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every tensor of `model` (a meta-device model of the run's
    architecture) in checkpoint `checkpoint`, one at a time: each in-memory tensor read, passed
    through `cast(in-memory name, tensor)` and split into its checkpoint tensors
    (`to_engine_weights`). Raises ExportError for a tensor the model does not have or lacks;
    `stats["largest_tensor_bytes"]`: the largest cast tensor."""
    from rl.models.name_maps import to_engine_weights
    expected = set(model.state_dict())
    seen: set[str] = set()
    stats["largest_tensor_bytes"] = 0
    for name, read in trainer_tensors(checkpoint / "trainer"):
        if name not in expected:
            raise ExportError(f"{checkpoint}: tensor {name} is not part of the "
                              f"{model.config.model_type} model")
        t = cast(name, read()).contiguous()
        stats["largest_tensor_bytes"] = max(stats["largest_tensor_bytes"],
                                            t.numel() * t.element_size())
        seen.add(name)
        for wire, piece in to_engine_weights(model, [(name, t)]):
            yield wire, piece.contiguous()
        del t
    if missing := sorted(expected - seen):
        raise ExportError(f"{checkpoint}: no tensor for {missing[0]} (and {len(missing) - 1} "
                          "more) of the model")


def export_hf(checkpoint: Path, model_dir: Path, out: Path, dtype: torch.dtype = torch.bfloat16,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES,
              say: Callable[[str], None] = print) -> dict:
    """Write checkpoint `checkpoint`'s actor into `out` (prepared by `prepare_out`) in `dtype`
    (fp32-kept modules stay fp32), with `model_dir`'s config, tokenizer and generation config.
    Returns the record also written to `out/export.json`."""
    checkpoint, model_dir, out = Path(checkpoint), Path(model_dir), Path(out)
    t0 = time.perf_counter()
    model = _meta_model(model_dir)
    rule = _dtype_rule(model, dtype)
    writer = ShardWriter(out, max_shard_bytes, say)
    stats: dict = {}
    for name, t in model_tensors(checkpoint, model, lambda n, t: t.to(rule(n, t)), stats):
        writer.add(name, t)
    shards = writer.finish()
    config = json.loads((model_dir / "config.json").read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    copy_model_files(model_dir, out, config)
    record = {"format": "hf", "checkpoint": str(checkpoint.resolve()), "model_dir": str(model_dir),
              "dtype": str(dtype).removeprefix("torch."), "shards": shards,
              "bytes": writer.total_bytes, "seconds": round(time.perf_counter() - t0, 3),
              **stats, "largest_shard_bytes": writer.peak_bytes}
    (out / "export.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def copy_model_files(model_dir: Path, out: Path, config: dict) -> None:
    """`config` as config.json, and `model_dir`'s tokenizer, generation config and other files
    that are not weights."""
    for p in sorted(model_dir.iterdir()):
        if p.is_file() and p.name not in _SKIP_FILES and not p.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copyfile(p, out / p.name)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for p in out.iterdir():
        os.chmod(p, 0o644)


def export_final(run_dir: Path, model_dir: Path, say: Callable[[str], None] = print) -> Path:
    """`checkpoint.export_final`: the run's last checkpoint into RUN_DIR/export/hf (replacing
    an earlier export), BF16; returns that directory. The checkpoint was sealed by this run, so
    only its sizes are checked."""
    checkpoint, manifest = find_checkpoint(run_dir, verify=False)
    out = Path(run_dir) / FINAL_EXPORT
    prepare_out(out, force=True)
    say(f"export: {checkpoint.name} -> {out}")
    record = export_hf(checkpoint, model_dir, out, say=say)
    say(f"export: step {manifest.get('step')} written in {record['seconds']:.1f}s "
        f"({record['bytes'] / 2**30:.2f} GiB, {len(record['shards'])} shard(s))")
    return out


def export_command(run_dir: Path, out: Path) -> str:
    """The command line that exports `run_dir`'s newest checkpoint (the run summary prints it)."""
    return f"python -m launch.export {run_dir} --format hf --out {out}"

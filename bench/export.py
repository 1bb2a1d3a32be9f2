"""`launch.export` on a real trainer checkpoint of the 2-layer DeepSeek-V4-Flash-dims model: wall
time and peak host memory of each format, against a plain copy of the same checkpoint (the disk's
read + write rate, measured in the same run) and DeepSpeed's own `zero_to_fp32` (the naive path).

The checkpoint is the production one: `bench.v4_layer`'s model (Flash dims, 2 layers: CSA and HCA,
`--experts` routed experts, BF16) is written as a model directory (`presets.save_model`), a real
`TrainerWorker` (DeepSpeed ZeRO-3, one rank, BF16, on the GPU when there is one) hosted in a plain
process (`rl.cluster.actors.ProcActor`, as a run without Ray hosts it) loads it, trains one step
on a small random batch (eager attention: the checkpoint does not depend on the kernel) and is
saved by the run's own `rl.checkpoint.Checkpointer` (every rank's files sealed with SHA-256, the
manifest, `latest`) into RUN_DIR/checkpoints/step_000001, with the run's config.yaml beside it
(`save_config`). driver.pt holds a stand-in driver state (step and
weight version, no sampler or pending rollouts): the export never reads it.

Then, each cold (the checkpoint's pages dropped from the page cache first, POSIX_FADV_DONTNEED),
each in a child process of its own (`bench.measure_child`: its `getrusage(RUSAGE_CHILDREN).
ru_maxrss`, plus its anonymous and file-backed RSS sampled from /proc every 20 ms):
- plain copy: the checkpoint's files read and written (16 MiB blocks, fsync'ed), as far as the
  disk holds a second copy (a partial copy's time is scaled to the whole checkpoint);
- `python -m launch.export RUN_DIR --format hf --out ...`, then `--format deepseek-v4` (FP4
  experts): the user's command, SHA-256 check included;
- DeepSpeed's `zero_to_fp32.py` (the recovery script every checkpoint carries) into fp32
  safetensors: the path one would take without `launch.export`;
- `launch.export RUN_DIR --format deepseek-v4 --experts fp8`.
`--budget-s` skips the steps the time left would not hold (judged by the step before), in
this order.
Every output is checked on a sample of the trainer's own weights (`TrainerWorker.
full_state_dict`: every tensor outside the routed experts, and routed experts 0 and last of every
layer): `hf` bit for bit (names and dtypes of all tensors against the model), `deepseek-v4`
converted back with `python -m launch.convert OUT --trainer-out ...` within each block's
rounding bound (the bound `tests/launch/test_export_deepseek.py` checks), `zero_to_fp32`'s fp32
masters rounded to BF16 bit for bit. Each output is deleted once checked, so the disk holds the
checkpoint plus one output at a time; the model directory's weights are deleted once the trainer
has loaded them (the export reads only its config.json and tokenizer).

Targets: peak RSS <= the export's largest shard + largest tensor + 2 GiB over the import baseline
(a child that imports what the export imports and builds its meta-device model), and wall time
<= 2 x the plain copy. Disk need: ZeRO-3 keeps fp32 masters and two Adam moments, 12 bytes a
parameter, plus the largest output (zero_to_fp32's fp32: 4 bytes a parameter); `--experts auto`
takes the most of 64 / 32 / 16 / 8 experts that fits the free disk (and the GPU's memory: ~20
bytes a parameter in training).
Left out: ZeRO 0-2, expert parallelism and several ranks (the CPU tests cover their layouts),
the MTP layer (no published checkpoint here: the deepseek-v4 layout follows DeepSeek-V4-Flash's
names), optimizer offload to NVMe.

Run: python -m bench.export [--experts auto|64|32|16|8] [--work DIR] [--budget-s S] [--no-naive]
     [--keep]
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import device_info, parse_args, write_results
from rl.trainer.worker import TrainerWorker

GiB = 2 ** 30
ROOT = Path(__file__).resolve().parents[1]
CANDIDATE_EXPERTS = (64, 32, 16, 8)
MARGIN = 2 * GiB
"""Free disk left over after the largest moment (the checkpoint plus the largest output)."""
FORMATS = (("hf", ["--format", "hf"]), ("deepseek-v4 fp4", ["--format", "deepseek-v4"]),
           ("deepseek-v4 fp8", ["--format", "deepseek-v4", "--experts", "fp8"]))
COLUMNS = ["row", "seconds", "vs_copy", "peak_rss_GiB", "peak_anon_GiB", "checkpoint_GiB",
           "output_GiB", "tensors", "ckpt_GBps", "export_s", "rss_target", "verified"]
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
BASELINE = """import sys
from pathlib import Path
import launch.export, rl.export, rl.export_deepseek, safetensors.torch
import deepspeed.utils.zero_to_fp32
from rl.export import _meta_model
print('meta model:', len(_meta_model(Path(sys.argv[1])).state_dict()), 'tensors')
"""


def say(text: str) -> None:
    print(f"[bench.export {time.strftime('%H:%M:%S')}] {text}", flush=True)


# ---- the model and the checkpoint ------------------------------------------------------------
def count_params(config) -> int:
    from transformers import DeepseekV4ForCausalLM
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM._from_config(config, dtype=torch.bfloat16)
    return sum(p.numel() for p in model.parameters())


def disk_need(params: int, naive: bool) -> int:
    """Bytes the run holds at its fullest: the ZeRO-3 checkpoint (fp32 master + 2 Adam moments)
    plus the largest output (zero_to_fp32's fp32, else a BF16 hf export or converted-back
    directory beside a deepseek-v4 export) plus the margin."""
    return 12 * params + (4 if naive else 3) * params + MARGIN


def choose_experts(args, free: int, gpu_bytes: int | None, smoke_fields: dict | None) -> tuple:
    """(config, number of parameters, why): `--experts N`, or under `auto` the most experts
    whose run fits the free disk and the GPU's free memory (ZeRO-3 on one GPU: ~20 bytes a
    parameter)."""
    from bench.v4_layer import flash_config
    if smoke_fields is not None:
        config = flash_config(**smoke_fields)
        return config, count_params(config), "smoke dims"
    choices = CANDIDATE_EXPERTS if args.experts == "auto" else (int(args.experts),)
    tried: list[str] = []
    for experts in choices:
        config = flash_config(experts)
        params = count_params(config)
        need = disk_need(params, not args.no_naive)
        gpu_need = 20 * params + 6 * GiB
        what = (f"{experts} experts: {params / 1e9:.2f} B parameters need {need / GiB:.1f} GiB "
                f"of disk ({free / GiB:.1f} free)" + (
                    f" and ~{gpu_need / GiB:.0f} GiB of GPU memory ({gpu_bytes / GiB:.0f} free)"
                    if gpu_bytes else ""))
        if need <= free and (gpu_bytes is None or gpu_need <= gpu_bytes):
            return config, params, "; ".join(tried + [what + ": taken"])
        tried.append(what)
    raise SystemExit(f"bench.export: no model fits: {'; '.join(tried)} (pass a smaller "
                     "--experts, --no-naive, or --work on a larger disk)")


def write_model_dir(config, device: str, out: Path) -> None:
    """The random BF16 model as a model directory (`presets.save_model`: checkpoint names,
    legacy V4 config fields, the character tokenizer)."""
    from bench.v4_layer import build_model
    from rl.models.presets import save_model
    from rl.models.tokenizer import build_char_tokenizer
    model = build_model(config, device).to("cpu")
    save_model(model, out, tokenizer=build_char_tokenizer())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def run_config(model_dir: Path, work: Path, device: str):
    """The run's config: configs/local_v4.yaml, this model, one BF16 ZeRO-3 rank on `device`."""
    from rl.config import load_config
    return load_config(ROOT / "configs" / "local_v4.yaml", [
        f"model.path={model_dir}", "model.warm_start=false", "model.dtype=bfloat16",
        "trainer.num_ranks=1", "trainer.zero_stage=3", f"trainer.device={device}",
        "trainer.micro_batch_tokens=4096", "trainer.warmup_steps=0", "trainer.lr=1.0e-4",
        # the checkpoint does not depend on the attention kernel; eager compiles nothing
        "trainer.attention_kernel=eager",
        f"output_dir={work}", "name=run"])


class SampledTrainer(TrainerWorker):
    """The production trainer rank, with one more method for this benchmark's check."""

    def save_sample(self, path: str, num_experts: int) -> int:
        """The trainer's full weights (`full_state_dict`, what the weight sync sends) restricted
        to every tensor outside the routed experts and routed experts 0 and last, into
        safetensors file `path`; returns the tensor count."""
        from safetensors.torch import save_file
        full = self.full_state_dict()
        keep = {n: t.contiguous() for n, t in full.items()
                if (m := _EXPERT.search(n)) is None or int(m.group(1)) in (0, num_experts - 1)}
        save_file(keep, path)
        return len(keep)


class _DriverState:
    """Stand-in for the driver's counters, sampler and pending rollouts in driver.pt."""

    def state_dict(self):
        return {"step": 1, "weight_version": 1}

    def load_state_dict(self, state) -> None:
        pass


def _batch(vocab: int, seed: int = 0):
    """Two random 256-token samples (64 prompt + 192 response tokens: past the HCA's rate of
    128, so both attention kinds see compressed entries)."""
    from rl.trainer.batch import TrainBatch
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (64,), generator=g).tolist() for _ in range(2)]
    responses = [torch.randint(3, vocab, (192,), generator=g).tolist() for _ in range(2)]
    return TrainBatch(prompt_ids=prompts, response_ids=responses,
                      rollout_logprobs=[[-4.5] * len(r) for r in responses],
                      advantages=[1.0, -1.0])


def train_and_checkpoint(cfg, model_dir: Path, sample_path: Path, config) -> dict:
    """One real trainer rank: load, one step, the run's checkpoint, the sample of its weights.
    Returns the checkpoint row."""
    from rl.checkpoint import Checkpointer
    from rl.cluster.actors import ProcActor, wait_all
    from rl.cluster.facades import TrainerGroup
    from rl.cluster.groups import free_port
    from rl.config import save_config
    from rl.resume import resume_hash
    from rl.trainer.worker import RankInfo
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, cfg.run_dir / "config.yaml")
    info = RankInfo(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port())
    t0 = time.perf_counter()
    actor = ProcActor(SampledTrainer, cfg.trainer, cfg.algorithm, cfg.sync, str(model_dir),
                      cfg.model.dtype, info, cfg.seed, 10, name="trainer-0")
    try:
        group = TrainerGroup([actor], cfg.cluster.deadlines)
        wait_all([actor.ready], cfg.cluster.deadlines.start_s, "starting the trainer")
        say(f"trainer ready in {time.perf_counter() - t0:.1f}s (DeepSpeed ZeRO-3, one rank, "
            f"{cfg.trainer.device})")
        for f in model_dir.glob("*.safetensors"):  # loaded: leave the disk to the checkpoint
            f.unlink()
        stats = group.train(_batch(config.vocab_size), 1)
        say(f"trained one step: loss {stats.metrics.get('train/loss', float('nan')):.4f}")
        state = _DriverState()
        checkpointer = Checkpointer(cfg, group, [state], state, state, resume_hash(cfg))
        path = checkpointer.save()
        seconds = checkpointer.last_seconds or 0.0  # set by every save
        n = actor.call("save_sample", str(sample_path), config.n_routed_experts).result(1800)
        say(f"checkpoint {path} in {seconds:.1f}s; a sample of {n} trainer tensors kept")
        actor.call("shutdown").result(30)
    finally:
        actor.close()
    size = dir_bytes(path)
    return {"row": "trainer checkpoint (save)", "seconds": seconds, "checkpoint_GiB": size / GiB,
            "output_GiB": size / GiB, "ckpt_GBps": size / 1e9 / seconds, "path": str(path),
            "files": len([p for p in path.rglob("*") if p.is_file()])}


# ---- measuring -------------------------------------------------------------------------------
def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def page_cache_gib() -> float:
    """The kernel's page cache (/proc/meminfo `Cached`), GiB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Cached:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def drop_cache(path: Path) -> None:
    """Write back and drop `path`'s files from the page cache: the next read comes from disk."""
    for p in Path(path).rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run_child(cmd: list[str], label: str) -> dict:
    """Run `cmd` (cwd: the repository) under `bench.measure_child`, echoing its output: exit
    status, wall seconds, peak RSS (its ru_maxrss), peak anonymous and file-backed RSS."""
    say(f"{label}: {' '.join(cmd)}")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "child.json"
        proc = subprocess.Popen([sys.executable, "-m", "bench.measure_child", str(record), *cmd],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        tail: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            print(f"  | {line}", end="", flush=True)
            tail = (tail + [line.rstrip()])[-20:]
        if proc.wait() != 0 or not record.is_file():
            raise RuntimeError(f"bench.measure_child failed (exit {proc.returncode}): {tail}")
        got = json.loads(record.read_text())
    say(f"{label}: exit {got['rc']} in {got['seconds']:.1f}s, peak RSS "
        f"{got['maxrss_kib'] / 2**20:.2f} GiB")
    return {"rc": got["rc"], "seconds": got["seconds"], "peak_rss_GiB": got["maxrss_kib"] / 2**20,
            "peak_anon_GiB": got["anon_kib"] / 2**20, "peak_file_GiB": got["file_kib"] / 2**20,
            "tail": tail}


def plain_copy(src: Path, dst: Path, room: int) -> dict:
    """Copy `src`'s files into `dst` (16 MiB reads and writes, each file fsync'ed), at most
    `room` bytes (the rest of a file that does not fit is left out); the row, with the time
    scaled to the whole of `src` when the copy was partial."""
    total = dir_bytes(src)
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    copied = 0
    t0 = time.perf_counter()
    for p in sorted(src.rglob("*")):
        if not p.is_file() or copied >= room:
            continue
        target = dst / p.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "rb", buffering=0) as fin, open(target, "wb", buffering=0) as fout:
            while copied < room and (n := fin.readinto(buf)):
                n = min(n, room - copied)
                fout.write(view[:n])
                copied += n
            os.fsync(fout.fileno())
    seconds = time.perf_counter() - t0
    full = seconds * total / max(copied, 1)
    shutil.rmtree(dst)
    say(f"plain copy: {copied / GiB:.2f} of {total / GiB:.2f} GiB in {seconds:.1f}s "
        f"({2 * copied / 1e9 / seconds:.2f} GB/s read + written)")
    return {"row": "plain copy (the limit)", "seconds": full, "checkpoint_GiB": total / GiB,
            "output_GiB": total / GiB, "ckpt_GBps": total / 1e9 / full,
            "copied_GiB": copied / GiB, "measured_s": seconds,
            "read_write_GBps": 2 * copied / 1e9 / seconds,
            "verified": "" if copied >= total else f"partial: {copied / GiB:.1f} GiB copied, "
                                                  "time scaled to the whole checkpoint"}


def output_facts(out: Path) -> dict:
    from safetensors import safe_open
    tensors = 0
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            tensors += len(list(h.keys()))
    return {"output_GiB": dir_bytes(out) / GiB, "tensors": tensors}


# ---- checking the outputs --------------------------------------------------------------------
def _where(out: Path) -> dict[str, Path]:
    """{tensor name: the safetensors file holding it} of a model directory."""
    from safetensors import safe_open
    found: dict[str, Path] = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            found.update(dict.fromkeys(h.keys(), f))
    return found


class Reader:
    """Reads single tensors of a model directory by name."""

    def __init__(self, out: Path):
        self.where = _where(out)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open
        with safe_open(str(self.where[name]), "pt") as h:
            return h.get_tensor(name)


def _sources(model) -> dict[str, str]:
    """{checkpoint name: the in-memory name it comes from} of a meta-device model."""
    from rl.models.name_maps import to_engine_weights
    out = {}
    for name, t in model.state_dict().items():
        for wire, _ in to_engine_weights(model, [(name, t)]):
            out[wire] = name
    return out


def expected_hf(model_dir: Path, sample: dict[str, torch.Tensor]) -> tuple[dict, set]:
    """(the sample as `--format hf` must write it: checkpoint names, BF16 except the
    architecture's fp32 modules, every name the model's export has)."""
    from rl.export import _dtype_rule, _meta_model
    from rl.models.name_maps import streams_checkpoint_names, to_engine_weights
    model = _meta_model(model_dir)
    rule = _dtype_rule(model, torch.bfloat16)
    sources = _sources(model)
    if streams_checkpoint_names(model):  # V4: the sample is in checkpoint names already
        want = {k: v.to(rule(sources[k], v)) for k, v in sample.items()}
    else:
        want = {k: v.contiguous() for k, v in to_engine_weights(
            model, [(n, t.to(rule(n, t))) for n, t in sample.items()])}
    return want, set(sources)


def check_hf(out: Path, model_dir: Path, sample: dict) -> str:
    want, names = expected_hf(model_dir, sample)
    got = Reader(out)
    if set(got.where) != names:
        return (f"FAILED: {len(names - set(got.where))} tensors missing, "
                f"{len(set(got.where) - names)} unexpected")
    bad = []
    for k, t in want.items():
        written = got[k]
        if written.dtype != t.dtype or not torch.equal(written, t):
            bad.append(k)
    if bad:
        return f"FAILED: {len(bad)} of {len(want)} sampled tensors differ (first {bad[0]})"
    return f"ok: all {len(names)} names; {len(want)} sampled tensors bit for bit"


def _bound(w: torch.Tensor, scale: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(each element's rounding bound, its block's scale) for a weight quantised to `kind`:
    half an e4m3 step (at most 16 scales, 2^-4 of the value) or half an e2m1 step (at most one
    scale, a quarter of the value above one scale)."""
    n, k = w.shape
    w = w.float().abs()
    if kind == "fp8":
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
        return torch.minimum(16 * full, torch.maximum(w / 16, full * 2.0 ** -10)), full
    full = scale.repeat_interleave(32, 1)[:n, :k]
    return torch.minimum(full, torch.maximum(full / 4, w / 4)), full


def check_deepseek(out: Path, back: Path, sample: dict) -> str:
    """`back` (the export converted again by launch.convert) against the trainer's sample:
    quantised weights within their block's bound, the others exactly the trainer's weights in
    the dtype the export stores them in."""
    exported, again = Reader(out), Reader(back)
    worst = {"fp8": 0.0, "fp4": 0.0}
    counts = {"fp8": 0, "fp4": 0, "exact": 0}
    for name, w in sample.items():
        if name not in again:
            return f"FAILED: {name} missing after launch.convert"
        got = again[name].float()
        scale_name = name.removesuffix("weight") + "scale"
        if name.endswith(".weight") and scale_name in exported:
            kind = "fp8" if exported[name].dtype == torch.float8_e4m3fn else "fp4"
            bound, full = _bound(w, exported[scale_name].float(), kind)
            err = (got - w.float()).abs()
            if not torch.all(err <= bound):
                return f"FAILED: {name} ({kind}) off by {(err - bound).max().item():.3g} " \
                       "beyond its bound"
            worst[kind] = max(worst[kind], (err / full).max().item())
            counts[kind] += 1
        else:
            if not torch.equal(got, w.to(exported[name].dtype).float()):
                return f"FAILED: {name} differs from the trainer's"
            counts["exact"] += 1
    return (f"ok: {counts['fp8']} fp8 / {counts['fp4']} fp4 sampled weights within bound (worst "
            f"{worst['fp8']:.2f} / {worst['fp4']:.2f} scales), {counts['exact']} exact")


def check_naive(out: Path, model_dir: Path, sample: dict) -> str:
    """zero_to_fp32's fp32 masters (in-memory names) rounded to BF16 == the trainer's sample."""
    from rl.export import _meta_model
    from rl.models.name_maps import to_engine_weights
    model = _meta_model(model_dir)
    sources = _sources(model)
    got = Reader(out)
    wanted = {sources[k] for k in sample}
    same = 0
    for name in sorted(wanted):
        if name not in got:
            continue  # buffers: zero_to_fp32 writes parameters only
        for wire, t in to_engine_weights(model, [(name, got[name])]):
            if wire in sample:
                if not torch.equal(t.to(torch.bfloat16), sample[wire].to(torch.bfloat16)):
                    return f"FAILED: {wire} differs from the trainer's weights"
                same += 1
    return f"ok: {same} sampled tensors equal the trainer's at BF16"


# ---- the rows --------------------------------------------------------------------------------
def export_row(label: str, fmt_args: list[str], run_dir: Path, out: Path, max_shard_gb: float,
               ckpt: Path, baseline: float, copy_s: float) -> dict:
    drop_cache(ckpt)
    cmd = [sys.executable, "-m", "launch.export", str(run_dir), *fmt_args, "--out", str(out),
           "--max-shard-gb", str(max_shard_gb)]
    row = {"row": f"export {label}", **run_child(cmd, f"export {label}")}
    row["checkpoint_GiB"] = dir_bytes(ckpt) / GiB
    if row["rc"] != 0:
        row["verified"] = f"FAILED: exit {row['rc']}"
        return row
    record = json.loads((out / "export.json").read_text())
    row.update(output_facts(out), export_s=record["seconds"], shards=len(record["shards"]),
               largest_shard_GiB=record["largest_shard_bytes"] / GiB,
               largest_tensor_GiB=record["largest_tensor_bytes"] / GiB,
               ckpt_GBps=row["checkpoint_GiB"] * GiB / 1e9 / row["seconds"],
               vs_copy=row["seconds"] / copy_s)
    limit = baseline + row["largest_shard_GiB"] + row["largest_tensor_GiB"] + 2
    row["rss_limit_GiB"] = limit
    row["rss_target"] = "met" if row["peak_rss_GiB"] <= limit else "not met"
    row["anon_target"] = "met" if row["peak_anon_GiB"] <= limit else "not met"
    row["time_target"] = "met" if row["vs_copy"] <= 2 else "not met"
    return row


def naive_row(ckpt: Path, out: Path, copy_s: float) -> dict:
    drop_cache(ckpt)
    trainer = ckpt / "trainer"
    cmd = [sys.executable, str(trainer / "zero_to_fp32.py"), str(trainer), str(out),
           "--safe_serialization", "-t", "ds"]
    row = {"row": "DeepSpeed zero_to_fp32 (naive)", **run_child(cmd, "zero_to_fp32")}
    row["checkpoint_GiB"] = dir_bytes(ckpt) / GiB
    if row["rc"] == 0:
        row.update(output_facts(out), vs_copy=row["seconds"] / copy_s,
                   ckpt_GBps=row["checkpoint_GiB"] * GiB / 1e9 / row["seconds"])
    else:
        row["verified"] = f"FAILED: exit {row['rc']}"
    return row


def convert_back(out: Path, back: Path) -> dict:
    return run_child([sys.executable, "-m", "launch.convert", str(out), "--trainer-out",
                      str(back)], "launch.convert back")


def mount_of(path: Path) -> dict:
    """The filesystem holding `path` (/proc/mounts' longest matching mount point)."""
    best = ("", "?", "?")
    real = str(Path(path).resolve())
    for line in Path("/proc/mounts").read_text().splitlines():
        dev, point, fstype = line.split()[:3]
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best[0]):
            best = (point, dev, fstype)
    return {"mount": best[0], "device": best[1], "fstype": best[2]}


def notes_for(rows: list[dict], info: dict) -> list[str]:
    copy = next((r for r in rows if r["row"].startswith("plain copy")), None)
    smoke = ", smoke run: not a measurement" if info["smoke"] else ""
    notes = [f"model: DeepSeek-V4 {info['model']}, {info['params']:,} parameters "
             f"({info['experts']} routed experts; {info['experts_choice']}), BF16; checkpoint: "
             f"DeepSpeed ZeRO-3, one rank on {info['trainer_device']}, one training step, "
             f"{info['checkpoint_GiB']:.2f} GiB (fp32 masters and Adam moments)",
             f"disk: {info['fs']['device']} ({info['fs']['fstype']}) at {info['fs']['mount']}, "
             f"{info['free_GiB']:.1f} GiB free at the start; every row starts with the "
             "checkpoint's pages dropped from the (guest's) page cache",
             f"import baseline (a child importing what the export imports, meta model built): "
             f"{info['baseline_GiB']:.2f} GiB peak RSS, {info['baseline_anon_GiB']:.2f} GiB "
             "anonymous"]
    if copy:
        notes.append(f"the limit: a plain copy reads and writes {copy['read_write_GBps']:.2f} "
                     f"GB/s together: {copy['seconds']:.1f}s for the whole checkpoint"
                     + (f" ({copy['verified']})" if copy.get("verified") else "")
                     + "; dropping the checkpoint's pages took the page cache from "
                     f"{copy['page_cache_GiB'][0]:.2f} to {copy['page_cache_GiB'][1]:.2f} GiB")
    for r in rows:
        if "rss_target" in r:
            notes.append(
                f"{r['row']}: peak RSS {r['peak_rss_GiB']:.2f} GiB vs target "
                f"{r['rss_limit_GiB']:.2f} GiB (baseline + shard {r['largest_shard_GiB']:.2f} + "
                f"tensor {r['largest_tensor_GiB']:.2f} + 2): {r['rss_target'].upper()}; "
                f"anonymous {r['peak_anon_GiB']:.2f} GiB: {r['anon_target'].upper()} "
                f"(file-backed peak {r['peak_file_GiB']:.2f} GiB: the memory-mapped checkpoint's "
                f"pages and the libraries); time {r['seconds']:.1f}s = {r['vs_copy']:.2f} x the "
                f"plain copy (target <= 2): {r['time_target'].upper()}{smoke}; "
                f"{r['export_s']:.1f}s of it exporting (export.json), the rest imports and the "
                "SHA-256 check of the checkpoint"
                + (f"; launch.convert back {r['convert_back_s']:.1f}s" if "convert_back_s" in r
                   else ""))
    for r in rows:
        if r["row"].startswith("DeepSpeed") and "vs_copy" in r:
            notes.append(f"{r['row']}: peak RSS {r['peak_rss_GiB']:.2f} GiB (anonymous "
                         f"{r['peak_anon_GiB']:.2f}), {r['seconds']:.1f}s = {r['vs_copy']:.2f} x "
                         "the plain copy; it writes fp32 in the module's names (not a model "
                         "directory: no config, no tokenizer)")
        elif str(r.get("verified", "")).startswith("skipped"):
            notes.append(f"{r['row']}: not run, the time left (--budget-s) would not hold it")
    notes.append("seconds: the child's wall time (imports included; the plain copy's scaled to "
                 "the whole checkpoint); ckpt_GBps: checkpoint bytes / seconds; peak_rss: the "
                 "child's ru_maxrss (bench.measure_child), file-backed pages included; "
                 "peak_anon: its "
                 "RssAnon sampled every 20 ms; export_s: export.json's own time; verified: "
                 "against a sample of the trainer's weights (every tensor outside the routed "
                 "experts, routed experts 0 and last)")
    return notes


# ---- the run ---------------------------------------------------------------------------------
def prepare_work(work: Path) -> None:
    """`work` missing, empty, or an earlier run's of this benchmark (marked): emptied."""
    marker = work / ".bench_export"
    if work.is_dir() and any(work.iterdir()):
        if not marker.is_file():
            raise SystemExit(f"bench.export: --work {work} is not empty and not this "
                             "benchmark's; pass an empty or missing directory")
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    marker.write_text("bench.export scratch space: removed at the end unless --keep\n")


def measure_exports(args, cfg, work: Path, ckpt: Path, sample: dict, baseline: float,
                    rows: list[dict], publish, deadline: float) -> None:
    """The plain copy, then each format (checked and deleted) and zero_to_fp32. A step that
    the time left (`deadline`, time.monotonic()) would not hold, judged by the one before it,
    is skipped and its row says so."""
    model_dir = Path(cfg.model.path)
    before = page_cache_gib()
    drop_cache(ckpt)
    after = page_cache_gib()
    copy = plain_copy(ckpt, work / "copy", shutil.disk_usage(work).free - MARGIN)
    copy["page_cache_GiB"] = [before, after]  # around the first drop
    rows.append(copy)
    publish()
    out, back = work / "out", work / "back"
    # the naive path before the fp8 variant: it is the comparison the targets are about
    steps = [*FORMATS[:2], *([] if args.no_naive else [("naive", [])]), *FORMATS[2:]]
    guess = 0.0
    for label, fmt_args in steps:
        if time.monotonic() + guess > deadline:
            rows.append({"row": "DeepSpeed zero_to_fp32 (naive)" if label == "naive"
                         else f"export {label}", "verified": "skipped: --budget-s"})
            say(f"{label}: skipped, {deadline - time.monotonic():.0f}s left, the step before "
                f"took {guess:.0f}s")
            continue
        t0 = time.monotonic()
        if label == "naive":
            row = naive_row(ckpt, out, copy["seconds"])
            if row["rc"] == 0:
                row["verified"] = check_naive(out, model_dir, sample)
        else:
            row = export_row(label, fmt_args, cfg.run_dir, out, args.max_shard_gb, ckpt,
                             baseline, copy["seconds"])
            if row["rc"] == 0:
                row.update(_check(label, out, back, model_dir, sample))
        say(f"{row['row']}: {row.get('verified')}")
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(back, ignore_errors=True)
        rows.append(row)
        publish()
        guess = time.monotonic() - t0


def _check(label: str, out: Path, back: Path, model_dir: Path, sample: dict) -> dict:
    if label == "hf":
        return {"verified": check_hf(out, model_dir, sample)}
    conv = convert_back(out, back)
    return {"convert_back_s": conv["seconds"],
            "verified": (check_deepseek(out, back, sample) if conv["rc"] == 0
                         else f"FAILED: launch.convert exit {conv['rc']}")}


def main() -> None:
    from bench.v4_layer import SMOKE
    args = parse_args(__doc__.splitlines()[0], lambda p: (
        p.add_argument("--experts", default="64",
                       choices=["auto", *(str(e) for e in CANDIDATE_EXPERTS)],
                       help="routed experts of the model (auto: the most that fit the disk)"),
        p.add_argument("--work", default=None,
                       help="scratch directory on the disk to measure (default "
                            "/var/tmp/bench_export); emptied first, removed at the end"),
        p.add_argument("--max-shard-gb", type=float, default=5.0),
        p.add_argument("--no-naive", action="store_true", help="leave zero_to_fp32 out"),
        p.add_argument("--budget-s", type=float, default=0.0,
                       help="skip the exports that would end past this many seconds from the "
                            "start (0: no limit)"),
        p.add_argument("--keep", action="store_true", help="keep the work directory")))
    start = time.monotonic()
    name = "export_smoke" if args.smoke else "export"
    work = Path(args.work or f"/var/tmp/bench_{name}")
    if args.smoke:
        args.max_shard_gb = min(args.max_shard_gb, 0.00005)  # several shards at tiny size
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    prepare_work(work)
    free = shutil.disk_usage(work).free
    gpu = torch.cuda.mem_get_info()[0] if device == "cuda" else None
    # compress rate 128 for HCA as in Flash: the legacy config form takes only 0 / 4 / 128
    # and experts 32 wide: FP4 packs one scale per 32 inputs
    smoke = dict(SMOKE, moe_intermediate_size=32,
                 compress_rates={"compressed_sparse_attention": 4,
                                 "heavily_compressed_attention": 128})
    config, params, why = choose_experts(args, free, gpu, smoke if args.smoke else None)
    info = {**device_info(), "model": "tiny smoke dims, 2 layers" if args.smoke else
            "V4-Flash dims, 2 layers (CSA, HCA)", "experts": config.n_routed_experts,
            "params": params, "trainer_device": device, "fs": mount_of(work),
            "free_GiB": free / GiB, "max_shard_gb": args.max_shard_gb, "work": str(work),
            "experts_choice": f"--experts {args.experts}: {why}", "smoke": args.smoke}
    say(f"{info['model']}, {config.n_routed_experts} experts: {params:,} parameters; "
        f"work in {work} ({free / GiB:.1f} GiB free, {info['fs']['fstype']})")
    rows: list[dict] = []

    def publish(quiet: bool = True) -> None:
        write_results(name, args.out, info, rows, COLUMNS, notes_for(rows, info), quiet=quiet)

    model_dir = work / "model"
    write_model_dir(config, device, model_dir)
    say(f"model directory written: {model_dir}")
    cfg = run_config(model_dir, work, device)
    rows.append(train_and_checkpoint(cfg, model_dir, work / "sample.safetensors", config))
    ckpt = Path(rows[0]["path"])
    info["checkpoint_GiB"] = rows[0]["checkpoint_GiB"]
    from safetensors.torch import load_file
    sample = load_file(str(work / "sample.safetensors"))
    base = run_child([sys.executable, "-c", BASELINE, str(model_dir)], "import baseline")
    info["baseline_GiB"], info["baseline_anon_GiB"] = base["peak_rss_GiB"], base["peak_anon_GiB"]
    publish()
    deadline = start + args.budget_s if args.budget_s else float("inf")
    measure_exports(args, cfg, work, ckpt, sample, base["peak_rss_GiB"], rows, publish, deadline)
    publish(quiet=False)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    failed = [r["row"] for r in rows if str(r.get("verified", "")).startswith("FAILED")]
    if failed:
        raise SystemExit(f"bench.export: failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()

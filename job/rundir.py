"""The run directory's life: one writer at a time (`RunDirLock`), and `--no-resume`, which
starts a run over by moving its old run directory aside, never by ignoring it.

**One writer.** Two processes writing one run directory delete each other's temporary
checkpoints, interleave their metrics and replace each other's Ray token file. A run holds
RUN_DIR/writer.lock: an exclusive `flock` on it while the job runs, and in it a JSON record of
the owner (host, pid, Slurm job id and restart count, since when). A second local run, a second
Slurm job, or `--no-resume` / `--resume-from` while a run holds the directory are refused with
exit status 2 and one line naming the holder. The record outlives the process on purpose:

- a Slurm job that is requeued comes back with the same SLURM_JOB_ID (and SLURM_RESTART_COUNT + 1),
  so its next life takes the lock over, while a different job is refused for as long as the
  recorded job is still known to Slurm as pending or running (`launch.submit` records the job id
  at submission, so a job waiting in the queue holds the directory too);
- a local run that died left a record of a process that no longer holds the flock: it is stale,
  and the next run takes over (saying whose lock it was).

`flock` does not reach across nodes on every shared file system (Lustre without `-o flock`); the
record then still refuses a second Slurm job, checked through `squeue`.

**Starting over.** Ignoring an old run directory is what went wrong before: the old checkpoints
stayed and retention (which keeps the highest steps) deleted the new run's, the trajectory log
refused steps older than its last, and on Slurm the pickled "do not resume" flag made every
requeued life start from step 0 again. With the old run moved away, the job always resumes: the
first life finds nothing and starts at step 0, and every later life of the same job resumes from
its own checkpoints.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

from job import slurm_env
from rl.config import ConfigError

log = logging.getLogger(__name__)

LOCK_FILE = "writer.lock"
SAME_JOB_WAIT_S = 60.0
"""How long a requeued job's new life waits for its previous life to let go of the flock."""
_ACTIVE = {"PENDING", "RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING", "REQUEUED",
           "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED",
           "SPECIAL_EXIT", "RESV_DEL_HOLD"}
"""Slurm job states in which a job may still write (squeue's %T)."""


class RunDirBusy(ConfigError):
    """Another run holds the run directory (exit 2, no requeue)."""


def _start_ticks(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc): with the pid, it names one
    process, even after the pid is reused."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def slurm_job_active(job_id: str) -> tuple[bool | None, str]:
    """(whether Slurm still knows `job_id` as pending or running, its state). None: cannot
    tell (squeue failed); False also where Slurm is not installed at all."""
    try:
        r = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True,
                           text=True, timeout=30)
    except FileNotFoundError:
        return False, "no Slurm on this machine"
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"squeue failed: {e}"
    if r.returncode != 0:
        if "invalid job id" in r.stderr.lower():
            return False, "gone"
        return None, f"squeue failed: {r.stderr.strip() or r.returncode}"
    states = r.stdout.split()
    return any(s in _ACTIVE for s in states), (states[0] if states else "gone")


class RunDirLock:
    """RUN_DIR/writer.lock (see the module doc). `hold()` is re-entrant within a process: the
    Slurm job takes the lock before Ray starts, `job.run.run_job` again around the run."""

    _held: dict[str, "RunDirLock"] = {}  # run directories this process holds, by path

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None
        self._flock_failed = False

    # ---- the owner record ------------------------------------------------------------------
    def owner(self) -> dict | None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        try:
            rec = json.loads(text) if text.strip() else None
        except json.JSONDecodeError:
            return None  # a record cut by a crash names nobody
        return rec if isinstance(rec, dict) else None

    @staticmethod
    def describe(rec: dict | None, state: str = "") -> str:
        if not rec:
            return "another process (no owner record)"
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec.get("since", 0)))
        if rec.get("pid") is None:  # recorded at submission
            where = f"submitted from {rec.get('submitted_from')} at {since}"
        else:
            where = f"pid {rec['pid']} on {rec.get('host')} since {since}"
        if rec.get("job_id"):
            return (f"Slurm job {rec['job_id']} ({state or 'state unknown'}; restart "
                    f"{rec.get('restart_count', 0)}, {where})")
        return f"a local run ({where})"

    @staticmethod
    def _record(**fields) -> dict:
        return {"host": socket.gethostname(), "pid": os.getpid(),
                "start_ticks": _start_ticks(os.getpid()), "job_id": slurm_env.job_id(),
                "restart_count": slurm_env.restart_count(), "since": time.time(), **fields}

    def _write(self, rec: dict) -> None:
        assert self._fd is not None
        data = (json.dumps(rec) + "\n").encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        os.fsync(self._fd)

    # ---- taking it -------------------------------------------------------------------------
    def _busy(self, rec: dict | None, flocked: bool) -> str | None:
        """Why the owner `rec` still holds the directory (`flocked`: this process got the
        flock); None when it does not."""
        if not flocked:
            return self.describe(rec)
        if not rec or (rec.get("job_id") and rec["job_id"] == slurm_env.job_id()):
            return None  # nobody, or an earlier life of this same Slurm job
        if rec.get("job_id"):
            active, state = slurm_job_active(rec["job_id"])
            if active is None:
                return (f"{self.describe(rec, state)}: cannot tell whether it still runs; if it "
                        f"has ended, remove {self.path}")
            return self.describe(rec, state) if active else None
        if rec.get("host") == socket.gethostname():
            # Its flock would stop us if it were alive; the pid (and its start time, against a
            # reused pid) decide where flock does not work.
            pid = rec.get("pid")
            alive = pid is not None and _start_ticks(int(pid)) == rec.get("start_ticks")
            return self.describe(rec) if alive and self._flock_failed else None
        # Another host's process cannot be checked from here, and flock may be node-local
        # (Lustre's localflock): only a person can tell.
        return (f"{self.describe(rec)}, which cannot be checked from {socket.gethostname()}; if "
                f"it has ended, remove {self.path}")

    def _try_flock(self) -> bool:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # type: ignore[arg-type]  # lint baseline (issue 39)
            return True
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                return False
            # flock unsupported here (e.g. some network file systems): the record decides
            log.warning("%s: flock unavailable (%s); relying on the owner record", self.path, e)
            self._flock_failed = True
            return True

    def acquire(self, record: bool = True,
                wait_same_job_s: float = SAME_JOB_WAIT_S) -> "RunDirLock":
        """Take the lock (and, with `record`, write this process's owner record) or raise
        RunDirBusy naming the holder. A holder that is an earlier life of this same Slurm job is
        waited for up to `wait_same_job_s`."""
        key = str(self.run_dir.resolve())
        if key in RunDirLock._held:
            return RunDirLock._held[key]
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + wait_same_job_s
        while True:
            flocked = self._try_flock()
            rec = self.owner()
            why = self._busy(rec, flocked)
            same_job = bool(rec and rec.get("job_id") and rec["job_id"] == slurm_env.job_id())
            if why is None or not (same_job and time.monotonic() < deadline):
                break
            time.sleep(1.0)
        if why is not None:
            self.release()
            raise RunDirBusy(f"{self.run_dir} is in use by {why}; wait for it to end, stop it, "
                             "or use another name")
        if record:
            if rec and rec.get("pid") not in (None, os.getpid()):
                log.info("%s: taking over from %s", self.path,
                         self.describe(rec, "an earlier life" if same_job else "ended"))
            self._write(self._record())
        RunDirLock._held[key] = self
        return self

    def release(self) -> None:
        """Let go of the flock; the owner record stays (see the module doc)."""
        RunDirLock._held.pop(str(self.run_dir.resolve()), None)
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None

    @contextlib.contextmanager
    def hold(self, record: bool = True) -> Iterator["RunDirLock"]:
        key = str(self.run_dir.resolve())
        nested = key in RunDirLock._held
        lock = self.acquire(record)
        try:
            yield lock
        finally:
            if not nested:
                lock.release()

    def check(self) -> None:
        """Raise RunDirBusy when another run holds the directory (takes and records nothing)."""
        if self.path.exists():
            with self.hold(record=False):
                pass

    def reserve(self, job_id: str) -> None:
        """Record the Slurm job just submitted for this directory as its owner, so that a
        second submission is refused while the job waits in the queue (best effort: skipped,
        with a warning, while a process holds the flock)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if not self._try_flock():
                log.warning("%s: held by %s; job %s not recorded as its owner", self.path,
                            self.describe(self.owner()), job_id)
                return
            self._write(self._record(job_id=str(job_id), restart_count=0, host=None, pid=None,
                                     start_ticks=None, submitted_from=socket.gethostname()))
        finally:
            os.close(self._fd)
            self._fd = None


def archive_run_dir(run_dir: Path, now: float | None = None) -> Path | None:
    """Rename an existing, non-empty `run_dir` to `<run_dir>.old-<UTC yyyymmdd-HHMMSS>` (a
    numbered suffix if that exists too) and return the new path; None when there is nothing to
    move. Nothing is deleted. Refused (RunDirBusy) while another run holds the directory."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return None
    with RunDirLock(run_dir).hold(record=False):  # moves with the directory; released after
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
        target = run_dir.with_name(f"{run_dir.name}.old-{stamp}")
        n = 1
        while target.exists():
            n += 1
            target = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{n}")
        run_dir.rename(target)
    return target

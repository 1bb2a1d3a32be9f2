"""What a user watches: the driver's own lines on the console, the libraries' chatter in a file.

On a CPU demo vLLM, Ray (every worker's output reaches the driver through `log_to_driver`),
DeepSpeed, transformers and Python warnings print hundreds of INFO/WARNING lines. Unless
`logging.verbose` is set, `job_console` points the job's file descriptors 1 and 2 at
RUN_DIR/logs/job.log - at the OS level, so child processes and C++ code follow - and keeps a
handle on the real stdout for what the user watches:

- `say()` lines: step lines, warm start, progress, summary (they go to the log too, for context);
- the driver's own log records, read back from the log: WARNING and above of the `rl`, `launch`
  and `slurm` loggers, and the INFO progress of CONSOLE_INFO_LOGGERS (runtime start, checkpoints);
- every error the log receives: ERROR/CRITICAL lines in the formats of vLLM, Ray, DeepSpeed,
  Python logging and glog, and whole Python tracebacks.

Records are read back from the log rather than sent to a second handler so that there is one
path to the console and no line shows twice.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from pathlib import Path
from typing import Iterator, TextIO

LOG_SUBDIR = "logs"
JOB_LOG = "job.log"
CONSOLE_INFO_LOGGERS = ("rl.runtime", "rl.checkpoint", "rl.loop", "rl.publisher")
"""Driver loggers whose INFO records are progress a user wants to see (the rest stay in the log)."""

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Ray's "(TrainerWorker pid=12, ip=10.0.0.1) " / "(raylet) " and vLLM's "(EngineCore pid=12) ".
_PREFIX = re.compile(r"^(?:\((?:raylet|gcs_server|[\w.:\- ]*pid=\d+[^)]*)\) ?)+")
# The level as vLLM ("ERROR 11-30 ..."), Ray ("2026-11-30 14:04:31,604\tERROR ..."), DeepSpeed
# ("[2026-11-30 14:04:51,614] [ERROR] ...") and Python logging ("ERROR name: ...") print it.
_LEVEL_ERROR = re.compile(r"^(?:\S+\s+){0,2}\[?(?:ERROR|CRITICAL|FATAL)\]?[\s:]")
_GLOG_ERROR = re.compile(r"^\[?[EF]\d{4} \d")  # C++ (torch, gloo): "[E1130 14:07:08.15 x.cpp:9]"
_OWN = re.compile(r"^(?P<level>INFO|WARNING|ERROR|CRITICAL) (?P<name>(?:rl|launch|slurm)(?:\.[\w.]+)?): ")
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")


class ConsoleFilter:
    """Decides, line by line, what of the job's log reaches the console (see the module doc).

    Stateful: inside a traceback every line up to and including the exception line is kept.
    """

    def __init__(self) -> None:
        self._in_traceback = False

    def keep(self, line: str) -> bool:
        body = _PREFIX.sub("", _ANSI.sub("", line.rstrip("\r\n")))
        if self._in_traceback:
            if not body or body[0].isspace():
                return True
            self._in_traceback = False  # the exception line ends the block
            return True
        if body.startswith("Traceback (most recent call last)") or body.startswith(_CHAINED):
            self._in_traceback = body.startswith("Traceback")
            return True
        own = _OWN.match(body)
        if own:
            return own["level"] != "INFO" or own["name"] in CONSOLE_INFO_LOGGERS
        return bool(_LEVEL_ERROR.match(body) or _GLOG_ERROR.match(body))


class JobConsole:
    """Redirects fds 1 and 2 to `log_path` while open; `say` writes to the real stdout."""

    def __init__(self, log_path: Path, poll_s: float = 0.5):
        self.log_path, self.poll_s = Path(log_path), poll_s
        self._lock = threading.RLock()  # RLock: a signal handler may log while say() holds it
        self._filter = ConsoleFilter()
        self._pos = 0
        self._partial = b""
        self._saved: tuple[int, int] | None = None
        self._out: TextIO | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def open(self) -> "JobConsole":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        _flush_std()
        log_fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._pos = os.fstat(log_fd).st_size  # a resumed run appends: forward only what is new
        self._saved = (os.dup(1), os.dup(2))
        self._out = os.fdopen(os.dup(self._saved[0]), "w", buffering=1, errors="replace")
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        self._thread = threading.Thread(target=self._follow, name="job-console", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            self._forward()
            _flush_std()
            if self._saved is not None:
                os.dup2(self._saved[0], 1)
                os.dup2(self._saved[1], 2)
                for fd in self._saved:
                    os.close(fd)
                self._saved = None
            if self._out is not None:
                self._out.close()
                self._out = None

    def say(self, text: str) -> None:
        with self._lock:
            self._forward()  # what the log received first is shown first
            self._out.write(text + "\n")  # type: ignore[union-attr]  # lint baseline (issue 39)
            self._out.flush()  # type: ignore[union-attr]  # lint baseline (issue 39)
            sys.stdout.write(text + "\n")
            sys.stdout.flush()

    def _follow(self) -> None:
        while not self._done.wait(self.poll_s):
            with self._lock:
                self._forward()

    def _forward(self) -> None:
        if self._out is None:
            return
        _flush_std()
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._pos)
                chunk = f.read()
        except OSError:
            return
        self._pos += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        shown = [ln for ln in (b.decode(errors="replace") for b in lines) if self._filter.keep(ln)]
        if shown:
            self._out.write("".join(_ANSI.sub("", ln.rstrip("\r")) + "\n" for ln in shown))
            self._out.flush()


_active: JobConsole | None = None


def say(text: str) -> None:
    """A line for the user: on the console (and in the job log while it is redirected)."""
    if _active is not None:
        _active.say(text)
    else:
        print(text, flush=True)


def quiet_libraries() -> None:
    """Warnings and up from our loggers; errors only from the libraries' own."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("transformers", "deepspeed", "DeepSpeed", "vllm", "ray", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)


def job_log(run_dir: Path) -> Path:
    return Path(run_dir) / LOG_SUBDIR / JOB_LOG


@contextlib.contextmanager
def job_console(run_dir: Path, verbose: bool) -> Iterator[Path | None]:
    """The job's console for its duration; yields the log path (None when `verbose`: then
    everything is printed as the libraries write it)."""
    global _active
    if verbose or _active is not None:
        yield None
        return
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # plain text in the log (Ray colours even files)
    console = JobConsole(job_log(run_dir)).open()
    _active = console
    try:
        yield console.log_path
    finally:
        _active = None
        console.close()


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass

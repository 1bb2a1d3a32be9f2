"""Sandboxed correctness calls (`reward.sandbox.enabled`), for rewards that run model output.

Each call runs in a child forked from its reward worker (safe: the worker's only other thread
sleeps between `getppid` calls and holds no lock; a few milliseconds), which before calling the
function:
- gets its own process group, and SIGKILL when the worker dies;
- has stdin, stdout and stderr on /dev/null and every other inherited descriptor closed (the
  worker's socket to the driver included);
- works in a new empty directory (also its HOME and TMPDIR), removed after the call, with an
  environment of PATH, locale and PYTHON* variables only;
- under Landlock (ABI >= 1): may write, create and remove only beneath that directory (and
  write /dev/null); may read and execute only the Python installation, `sys.path`, the system
  directories (/usr, /lib*, /bin, /sbin) and a few device files, and of those nothing in the
  protected paths (the run directory, the data files); ABI >= 4 also denies TCP bind/connect,
  ABI >= 6 signals to processes outside the sandbox and abstract unix sockets;
- has hard resource limits (they cannot be raised again): RLIMIT_CPU, RLIMIT_AS (on top of what
  the worker maps), RLIMIT_NOFILE, RLIMIT_FSIZE, RLIMIT_NPROC (not enforced for root) and no core
  files.
A child is used per call because rlimits are per process and hard limits only go down: set in
the worker, they would accumulate CPU time over calls and could not be lifted for the next one.
After the call (or at the time limit) the child's process group is killed, then every other
process left behind (the worker is a child subreaper, so orphans come back to it).

The result comes back as a small JSON text, never a pickle: the worker must not unpickle what
model output wrote. Not covered (docs/rewards.md): no seccomp filter (every syscall is allowed),
no namespaces (the process tree, UDP and unix sockets, /proc of other processes as far as
ptrace rules allow), and code in the sandboxed process can write its own result, so a reward
that executes model output in the same process as its check can be fooled: run the model's code
in a subprocess and judge its output in the plugin.
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # every architecture
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1, 1 << 1, 1 << 2, 1 << 3
_FS_CHANGES = sum(1 << i for i in range(4, 13))  # remove dir/file, make char/dir/reg/sock/...
_FS_REFER, _FS_TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 1 << 1  # ABI 4
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1, 1 << 1  # ABI 6
_READ = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
_FILE_RIGHTS = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc/ld.so.cache",
               "/dev/zero", "/dev/urandom", "/dev/random")
MAX_RESULT_BYTES = 4096
KEPT_ENV = ("PATH", "LANG", "LANGUAGE", "TZ", "PYTHONPATH", "PYTHONHASHSEED", "PYTHONIOENCODING")
"""The environment variables a sandboxed call keeps (and LC_*); HOME and TMPDIR are its own
directory."""


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 without Landlock (or not on Linux)."""
    if not sys.platform.startswith("linux"):
        return 0
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    version = libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(int(version), 0)


def readable_paths(roots: list[str], protect: list[str]) -> list[str]:
    """What covers every path beneath `roots` except the `protect`ed ones and what lies beneath
    them: a root without protected paths inside is kept whole, one with some is replaced by its
    entries, recursively (Landlock grants access beneath a path, never "all but")."""
    protected = [Path(os.path.realpath(p)) for p in protect]
    out = []
    for root in roots:
        path = Path(os.path.realpath(root))
        if not path.exists() or any(path == p or path.is_relative_to(p) for p in protected):
            continue
        inside = [p for p in protected if p.is_relative_to(path)]
        if not inside:
            out.append(str(path))
        elif path.is_dir():
            out.extend(readable_paths([str(e) for e in path.iterdir()], [str(p) for p in inside]))
    return sorted(set(out))


class Sandbox:
    """Runs correctness calls in sandboxed children of this (worker) process."""

    def __init__(self, limits, timeout_s: float, protect: list[str]):
        """`limits`: `rl.config.RewardSandboxConfig`; `timeout_s`: wall time per call (0 =
        none); `protect`: paths no call may read."""
        self.limits, self.timeout_s = limits, timeout_s
        self.abi = landlock_abi()
        roots = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                 os.path.dirname(os.path.realpath(sys.executable)), *SYSTEM_DIRS,
                 *(os.path.abspath(p) for p in sys.path)]
        self.readable = readable_paths(roots, protect) if self.abi else []
        _libc().prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans of a call come back here

    def call(self, fn, response: str, answer: str, meta: dict) -> tuple[bool, object]:
        workdir = tempfile.mkdtemp(prefix="rl-reward-")
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the sandboxed child: never returns
            os.close(read_fd)
            _child(fn, (response, answer, meta), self, workdir, write_fd)
        os.close(write_fd)
        try:
            text, timed_out = _read_result(read_fd, self.timeout_s)
        finally:
            os.close(read_fd)
            status = _end(pid)
            shutil.rmtree(workdir, ignore_errors=True)
        if timed_out:
            return False, (f"TimeoutError: no result within reward.verify_timeout_s="
                           f"{self.timeout_s:g}s (sandboxed call killed)")
        try:
            result = json.loads(text) if text else None
        except ValueError:
            result = None
        if isinstance(result, dict) and result.get("ok") is True:
            from rl.rewards.plugin import reward_value
            try:
                return True, reward_value(result.get("value"))
            except (TypeError, ValueError) as e:
                return False, f"{type(e).__name__}: {e}"
        if isinstance(result, dict) and isinstance(result.get("error"), str):
            return False, result["error"][:500]
        return False, f"SandboxError: the sandboxed call {_describe(status)} without a result"


def _read_result(fd: int, timeout_s: float) -> tuple[bytes, bool]:
    """What the child wrote until it closed the pipe, and whether the time ran out first."""
    deadline = time.monotonic() + timeout_s if timeout_s > 0 else float("inf")
    chunks: list[bytes] = []
    size = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"", True
        readable, _, _ = select.select([fd], [], [], min(left, 3600.0))
        if not readable:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks), False
        size += len(chunk)
        if size <= MAX_RESULT_BYTES:
            chunks.append(chunk)


def _end(pid: int) -> int:
    """Kill the child's process group and every process that came back to us (a double fork,
    a new session); the child's wait status."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _, status = os.waitpid(pid, 0)
    while True:  # orphans of the call: we are their subreaper
        try:
            orphan, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if orphan == 0:
            for child in _children():
                try:
                    os.kill(child, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.001)


def _children() -> list[int]:
    me, out = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(b")", 1)[1].split()[1]) == me:  # field 4: ppid
                out.append(int(entry))
    return out


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        hint = {"SIGXCPU": " (reward.sandbox.cpu_s)", "SIGXFSZ": " (reward.sandbox.file_mb)"}
        return f"was killed by {name}{hint.get(name, '')}"
    return f"exited with status {os.WEXITSTATUS(status)}"


def _child(fn, args: tuple, box: Sandbox, workdir: str, result_fd: int) -> None:
    """In the forked child: enter the sandbox, call, write `{"ok": true, "value": x}` or
    `{"error": "..."}` to `result_fd`, exit. Never returns."""
    try:
        os.setpgid(0, 0)
        _libc().prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the worker
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write raises EFBIG instead
        null = os.open(os.devnull, os.O_RDWR)
        for std in (0, 1, 2):
            os.dup2(null, std)
        os.closerange(3, result_fd)
        os.closerange(result_fd + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        os.chdir(workdir)
        kept = {k: v for k, v in os.environ.items() if k in KEPT_ENV or k.startswith("LC_")}
        os.environ.clear()  # the driver's environment may hold tokens (HF_TOKEN, W&B keys)
        os.environ.update(kept, HOME=workdir, TMPDIR=workdir)
        tempfile.tempdir = workdir
        limits = _rlimits(box.limits)  # reads /proc, which Landlock then hides
        if box.abi:
            _landlock(box.abi, box.readable, workdir)
        for which, value in limits:
            resource.setrlimit(which, value)
    except BaseException as e:
        _write(result_fd, {"error": f"SandboxError: cannot enter the sandbox: "
                                    f"{type(e).__name__}: {e}"})
        os._exit(0)
    try:
        from rl.rewards.plugin import reward_value
        message: dict[str, object] = {"ok": True, "value": reward_value(fn(*args))}
    except BaseException as e:  # sys.exit, MemoryError, PermissionError: a failed sample
        message = {"error": f"{type(e).__name__}: {e}"[:1000]}
    try:
        _write(result_fd, message)
    finally:
        os._exit(0)


def _write(fd: int, message: dict) -> None:
    os.write(fd, json.dumps(message)[:MAX_RESULT_BYTES].encode())


def _rlimits(limits) -> list[tuple[int, tuple[int, int]]]:
    """(resource, (soft, hard)) for the call's process."""
    mib = 1 << 20
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    hard = [(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1)),
            (resource.RLIMIT_AS, (mapped + limits.memory_mb * mib,) * 2),
            (resource.RLIMIT_NOFILE, (limits.open_files,) * 2),
            (resource.RLIMIT_FSIZE, (limits.file_mb * mib,) * 2),
            (resource.RLIMIT_CORE, (0, 0))]
    if os.getuid() != 0:  # counts all of the user's processes; root is exempt anyway
        hard.append((resource.RLIMIT_NPROC, (_user_processes() + limits.processes,) * 2))
    return hard


def _user_processes() -> int:
    uid, count = os.getuid(), 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                count += os.stat(f"/proc/{entry}").st_uid == uid
            except OSError:
                pass
    return count


def _landlock(abi: int, readable: list[str], workdir: str) -> None:
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    write = _FS_WRITE_FILE | _FS_CHANGES | (_FS_REFER if abi >= 2 else 0) | (
        _FS_TRUNCATE if abi >= 3 else 0)
    attr = _RulesetAttr(handled_access_fs=_READ | write,
                        handled_access_net=_NET_BIND_TCP | _NET_CONNECT_TCP if abi >= 4 else 0,
                        scoped=_SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size),
                           ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")

    def allow(path: str, access: int) -> None:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        try:
            if not os.path.isdir(path):
                access &= _FILE_RIGHTS
            rule = _PathBeneathAttr(allowed_access=access, parent_fd=fd)
            if libc.syscall(_SYS_ADD_RULE, ruleset, 1, ctypes.byref(rule), 0) < 0:
                raise OSError(ctypes.get_errno(), f"landlock_add_rule failed for {path}")
        finally:
            os.close(fd)

    try:
        for path in readable:
            allow(path, _READ)
        allow(workdir, _READ | write)
        allow(os.devnull, _FS_READ_FILE | _FS_WRITE_FILE | (_FS_TRUNCATE if abi >= 3 else 0))
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS, required by restrict_self
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if libc.syscall(_SYS_RESTRICT_SELF, ruleset, 0) < 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)

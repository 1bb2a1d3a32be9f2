"""Reward worker processes: correctness calls run outside the driver, in parallel, time-limited.

A call that hangs past `reward.verify_timeout_s`, crashes its process (a segfault, `os._exit`),
calls `sys.exit` or raises is one failed sample: the worker is killed and replaced when it hung
or died, and the batch goes on over the other workers. While it waits, `map` polls `cancelled`
every POLL_S, so a stop request never waits for a reward function.

Workers are fresh interpreters (`python -m rl.rewards.worker`), started once and reused, not
forked from the driver: the driver holds threads (Ray's, torch's intra-op pool, logging) whose
locks a fork copies in whatever state they are, so a forked child can deadlock on one, and
possibly a CUDA context; multiprocessing's `spawn` and `forkserver` would re-import the driver's
`__main__` (submitit's entry point, and torch with it) in every worker. A fresh interpreter
imports only the rewards code and the plugin (about 0.3 s; `math` adds math-verify's warm-up,
2-3 s, before the worker takes calls).

Messages on a worker's socket (pickled by `multiprocessing.connection`):
driver -> worker: the init dict, then `(tag, response, answer, meta)` per call;
worker -> driver: `("imported",)`, `("ready",)`, `("config_error", message)`,
`("result", tag, ok, value_or_message)`.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable

from rl.config import ConfigError, RewardSandboxConfig
from rl.rewards.sandbox import landlock_abi
from rl.signals import StepAbandoned

log = logging.getLogger(__name__)

POLL_S = 0.05
"""How often a waiting `map` checks `cancelled` (and the deadlines)."""
START_TIMEOUT_S = 300.0
"""A worker that has not imported and warmed its function this long after the pool began waiting
for it is a fault (not a sample's). Counted from the first wait, not from the worker's start: a
pool may sit idle for longer between its start and its first `map` (a long SFT warm start),
with the worker's "ready" unread in its socket."""
SANDBOX_GRACE_S = 5.0
"""With the sandbox the worker enforces the time limit itself (it kills the call's process);
the driver kills the worker only when it is this much later still."""
QUEUE_DEPTH = 2
"""Calls sent ahead to a worker: the next one starts the moment one ends, not after a round trip
through the driver (which, on a busy node, first waits for a CPU)."""
MAX_START_FAILURES = 3
"""Workers dying in a row before they are ready: the pool gives up (RuntimeError)."""
BUILTIN = ("math", "exact")
Outcome = tuple[bool, Any]
"""(True, reward) or (False, "ErrorType: message")."""


def auto_workers() -> int:
    """`reward.num_workers: auto`: half the CPUs this process may use, 1 to 8 (the driver
    shares its node with the engines' and trainers' own CPU work)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 2
    return max(1, min(8, cpus // 2))


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "is unresponsive"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


Tag = tuple[int, int]
"""(batch, index) of a call."""


@dataclass(slots=True)
class _Worker:
    proc: subprocess.Popen
    conn: Connection
    state: str = "starting"
    """`starting` (importing the function), `warming` or `ready`."""
    start_deadline: float | None = None
    """When it is a fault if not ready yet: set the first time the pool waits for it."""
    queue: deque[Tag] = field(default_factory=deque)
    """The calls sent to it, in order: the first is running, the others wait in its socket."""
    deadline: float = float("inf")
    """When the running call times out."""


class RewardPool:
    """`num_workers` worker processes running the correctness function `function` (`math`,
    `exact` or a dotted path); `map` scores a batch over them.

    The class attributes below name what the workers run; `rl.envs.pool.EnvPool` reuses the
    machinery for environment steps."""
    WORKER_MODULE = "rl.rewards.worker"
    """The worker's module (`python -m WORKER_MODULE FD DRIVER_PID`)."""
    KIND = "reward"
    """How messages name a worker ("reward worker 123")."""
    TIMEOUT_KEY = "reward.verify_timeout_s"
    """The config key of the per-call time limit, for the timeout message."""

    def __init__(self, function: str, num_workers: int, timeout_s: float,
                 sandbox: RewardSandboxConfig | None = None, protect: tuple[str, ...] = ()):
        """`timeout_s`: per call (0 = none); `sandbox`: per-call limits (None = off);
        `protect`: paths a sandboxed call may not read (the run directory, the data files).
        Raises ConfigError when a plugin cannot be imported (or the sandbox cannot be had)."""
        if num_workers < 1:
            raise ValueError(f"RewardPool: num_workers {num_workers}, expected >= 1")
        self.function, self.timeout_s = function, timeout_s
        self.sandboxed = sandbox is not None
        self.restarts = 0
        """Workers killed and replaced (a call hung or crashed its worker), over the pool's life."""
        self._init = {"function": function, "sys_path": list(sys.path), "timeout_s": timeout_s,
                      "sandbox": sandbox, "protect": [str(p) for p in protect]}
        self._workers: list[_Worker] = []
        self._batch = 0
        self._start_failures = 0
        # Killed with the pool, or at exit when nobody closed it (and a worker exits by itself
        # when the driver's process is gone: rl.rewards.worker).
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)
        if sandbox is not None and sandbox.require_landlock and not landlock_abi():
            raise ConfigError("reward.sandbox.require_landlock: true, but this kernel has no "
                              "Landlock (Linux >= 5.13 with the LSM enabled); set it to false "
                              "to run with the resource limits only (docs/rewards.md)")
        try:
            for _ in range(num_workers):
                self._workers.append(self._spawn())
            if function not in BUILTIN:  # a plugin that cannot import is a config error now
                self._await(lambda w: w.state != "starting", f"import the {self.KIND} function")
        except BaseException:
            self.close()
            raise

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def wait_ready(self) -> None:
        """Block until every worker has imported and warmed its function (math-verify's import
        and first parse take seconds: a benchmark or a test may want them out of the way)."""
        self._await(lambda w: w.state == "ready", "warm up")

    def map(self, calls: list[tuple[str, str, dict]],
            cancelled: Callable[[], bool] | None = None) -> list[Outcome]:
        """One outcome per `(response, answer, meta)`, in order; the values do not depend on
        the number of workers. Raises StepAbandoned as soon as `cancelled()` is true (calls in
        flight finish or time out in the background; their results are dropped)."""
        self._batch += 1
        batch, out = self._batch, [None] * len(calls)
        todo, left = deque(range(len(calls))), len(calls)
        while left:
            if cancelled is not None and cancelled():
                raise StepAbandoned(f"stop requested while scoring "
                                    f"({len(calls) - left} of {len(calls)} done)")
            for w in self._workers:
                while todo and w.state == "ready" and len(w.queue) < QUEUE_DEPTH:
                    i = todo.popleft()
                    if not self._send(w, (batch, i), calls[i]):
                        todo.appendleft(i)  # it never ran: another worker takes it
                        break
            now = time.monotonic()
            next_deadline = min((w.deadline for w in self._workers), default=now + POLL_S)
            ready = wait([w.conn for w in self._workers],
                         timeout=max(0.0, min(POLL_S, next_deadline - now)))
            events = []
            for w in [w for w in self._workers if w.conn in ready]:
                events += self._receive(w)
            now = time.monotonic()
            for w in [w for w in self._workers if w.deadline < now]:
                message = (f"TimeoutError: no result within {self.TIMEOUT_KEY}="
                           f"{self.timeout_s:g}s (worker killed and replaced)")
                events += self._fail_and_replace(w, "hung", message)
            for (b, i), outcome in events:
                if b != batch:
                    continue  # a call of a batch given up on (a stop): its result is dropped
                if outcome is None:
                    todo.appendleft(i)  # sent to a worker that died before it started
                else:
                    out[i], left = outcome, left - 1  # type: ignore[call-overload]  # lint baseline (issue 39)
            self._check_starting(now)
        return out  # type: ignore[return-value]  # lint baseline (issue 39)

    def close(self) -> None:
        """Kill the workers (idempotent)."""
        self._finalizer()

    # -- internals ---------------------------------------------------------------------------
    def _spawn(self) -> _Worker:
        import rl
        parent, child = socket.socketpair()
        root = str(Path(rl.__file__).resolve().parents[1])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        try:
            # Its own session: a terminal's Ctrl-C is for the driver, and killing the worker's
            # process group also ends what a plugin started.
            proc = subprocess.Popen(
                [sys.executable, "-m", self.WORKER_MODULE, str(child.fileno()), str(os.getpid())],
                pass_fds=[child.fileno()], env=env, start_new_session=True)
        finally:
            child.close()
        conn = Connection(parent.detach())
        conn.send(self._init)
        return _Worker(proc, conn)

    def _send(self, w: _Worker, tag: Tag, call: tuple) -> bool:
        try:
            w.conn.send((tag, *call))
        except OSError:  # it died; what it had in hand is seen on its next receive
            return False
        w.queue.append(tag)
        if len(w.queue) == 1:
            w.deadline = self._deadline()
        return True

    def _deadline(self) -> float:
        if self.timeout_s <= 0:
            return float("inf")
        return time.monotonic() + self.timeout_s + (SANDBOX_GRACE_S if self.sandboxed else 0.0)

    def _receive(self, w: _Worker) -> list[tuple[Tag, Outcome | None]]:
        """Handle one message of `w`: [(tag, outcome)] for a finished call; for a dead worker,
        its running call failed and the calls it never started with outcome None."""
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            return self._fail_and_replace(w, "died", None)
        kind = msg[0]
        if kind == "result":
            _, tag, ok, value = msg
            assert w.queue and w.queue[0] == tag, (tag, w.queue)  # calls run in order
            w.queue.popleft()
            w.deadline = self._deadline() if w.queue else float("inf")
            return [(tag, (ok, value))]
        if kind == "imported":
            w.state = "warming"
        elif kind == "ready":
            w.state, self._start_failures = "ready", 0
        elif kind == "config_error":
            raise ConfigError(msg[1])
        return []

    def _fail_and_replace(self, w: _Worker, why: str,
                          message: str | None) -> list[tuple[Tag, Outcome | None]]:
        """Kill `w` (and its process group) and start a new worker in its place: its running
        call failed (`message`, or how the worker ended), the others never started (None)."""
        queue = list(w.queue)
        code = _kill(w)
        if w.state != "ready":
            self._start_failures += 1
            if self._start_failures >= MAX_START_FAILURES:
                raise RuntimeError(f"{self.KIND} workers for {self.function!r} keep dying before "
                                   f"they are ready (the last {describe_exit(code)})")
        else:
            self.restarts += 1
            log.warning("%s worker %d %s (%s); replacing it", self.KIND, w.proc.pid, why,
                        describe_exit(code))
        new = self._spawn()
        w.proc, w.conn, w.state, w.start_deadline, w.queue, w.deadline = (
            new.proc, new.conn, "starting", None, deque(), float("inf"))
        if not queue:
            return []
        message = message or (f"WorkerDied: the {self.KIND} worker {describe_exit(code)} during "
                              f"the call (replaced)")
        return [(queue[0], (False, message))] + [(tag, None) for tag in queue[1:]]

    def _check_starting(self, now: float) -> None:
        """Called while waiting (`map`, `_await`): a worker still not ready START_TIMEOUT_S
        after the pool first waited for it is a fault, once what it has sent is read (a pool
        that sat idle reads one message a worker per round: "ready" may be next)."""
        def late(w: _Worker) -> bool:
            return (w.state != "ready" and w.start_deadline is not None
                    and now > w.start_deadline)
        for w in self._workers:
            if w.state != "ready" and w.start_deadline is None:
                w.start_deadline = now + START_TIMEOUT_S
            while late(w) and w.conn.poll():
                self._receive(w)  # a starting worker has no calls: no outcome is lost
            if late(w):
                raise RuntimeError(f"{self.KIND} worker {w.proc.pid} for {self.function!r} was not "
                                   f"ready {START_TIMEOUT_S:g}s after the pool began waiting "
                                   "for it")

    def _await(self, done: Callable[[_Worker], bool], what: str) -> None:
        while not all(done(w) for w in self._workers):
            ready = wait([w.conn for w in self._workers if not done(w)], timeout=POLL_S)
            for w in [w for w in self._workers if w.conn in ready]:
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):
                    raise RuntimeError(f"{self.KIND} worker {w.proc.pid} {describe_exit(_kill(w))} "
                                       f"before it could {what}") from None
                if msg[0] == "config_error":
                    raise ConfigError(msg[1])
                w.state = {"imported": "warming", "ready": "ready"}.get(msg[0], w.state)
            self._check_starting(time.monotonic())


def _kill(w: _Worker) -> int | None:
    try:
        os.killpg(w.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        code = w.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        code = None
    w.conn.close()
    return code


def _kill_all(workers: list[_Worker]) -> None:
    for w in workers:
        _kill(w)

"""Hosting plain worker classes as actors: in Ray, or in plain processes where Ray is absent.

The driver speaks one explicit vocabulary for both: `handle.call("method", *args)` returns a
`Future`; `wait_all(futures)` collects results. No decorators, no generated classes: a worker is
an ordinary Python class you can also instantiate in a debugger.

Failures look the same on both backends: an exception a worker method raises reaches the driver
as its own type (Ray: `RayTaskError` subclassing it; plain processes: the unpickled exception,
chained from a `RemoteError` holding the worker's traceback); a dead worker is `ActorDied`; a
`result(timeout)` that runs out is a `TimeoutError` (`ray.exceptions.GetTimeoutError` is one).

`wait_all` is how the driver waits on a group: bounded by a deadline (`CallTimeout`, naming the
call, the ranks that did not answer and the config key that sets the deadline), and failing fast:
the first rank that fails ends the wait, since the others may be blocked for good in a collective
with a rank that died.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import multiprocessing as mp
import os
import pickle
import threading
import time
import traceback
from concurrent.futures import Future as _CFuture
from typing import Any


class ActorDied(RuntimeError):
    """The process hosting an actor is gone (crash, OOM, kill -9)."""


class CallTimeout(TimeoutError):
    """A remote call of a worker group did not answer within its deadline (a hung rank, a node
    that stopped answering): the run fails, and the launcher requeues or restarts it."""

    def __init__(self, what: str, deadline_s: float | None, key: str | None = None,
                 waiting_for: list[str] | None = None):
        who = f" ({', '.join(waiting_for)} did not answer)" if waiting_for else ""
        raise_it = f"; raise {key} if it can legitimately take longer" if key else ""
        super().__init__(f"{what}: no answer within {deadline_s or 0:g} s{who}{raise_it}")
        self.what, self.deadline_s, self.key = what, deadline_s, key


class Future:
    name: str = "?"
    """The actor that answers it (`trainer-1`, `rollout-0`), for error messages."""

    def result(self, timeout: float | None = None) -> Any:  # pragma: no cover - interface
        raise NotImplementedError

    def done(self) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    @staticmethod
    def wait_any(futures: list[Any], timeout: float) -> None:
        """Returns once one of `futures` is done, or after `timeout` s."""
        deadline = time.monotonic() + timeout
        while not any(f.done() for f in futures) and time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


def wait_all(futures: list[Future], deadline_s: float | None = None, what: str = "a remote call",
             *, key: str | None = None, fail_fast: bool = True,
             timeout: float | None = None) -> list[Any]:
    """Every future's result, in order.

    `deadline_s` bounds the whole wait: past it, `CallTimeout` names `what`, the actors that did
    not answer and `key` (the config key that sets the deadline). `fail_fast`: the first future
    that fails raises its error at once, however many others are still running (a rank that died
    leaves its peers blocked in a collective); without it the futures are awaited in order, as a
    weight update needs (its sender and receivers end together or time out together).
    `timeout`: the former name of `deadline_s`.
    """
    deadline_s = timeout if deadline_s is None else deadline_s
    deadline = None if deadline_s is None else time.monotonic() + deadline_s

    def left() -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def timed_out(pending) -> CallTimeout:
        return CallTimeout(what, deadline_s, key, [f.name for f in pending])

    if not fail_fast:
        try:
            return [f.result(left()) for f in futures]
        except CallTimeout:
            raise
        except TimeoutError as e:
            raise timed_out([f for f in futures if not f.done()]) from e
    return wait_each(futures, deadline_s, what, key=key, fatal=(Exception,))


def wait_each(futures: list[Future], deadline_s: float | None = None,
              what: str = "a remote call", *, key: str | None = None,
              fatal: tuple[type[BaseException], ...] = (ActorDied,)) -> list[Any]:
    """Every future's result or, where it failed, its exception (in order), waiting for all of
    them, except that an error of a `fatal` type raises at once (by default a dead actor: its
    peers may never answer). `CallTimeout` past `deadline_s`, as `wait_all`."""
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    results: list[Any] = [None] * len(futures)
    pending = dict(enumerate(futures))
    while True:
        for i, f in list(pending.items()):
            if f.done():
                del pending[i]
                try:
                    results[i] = f.result(0)
                except fatal:
                    raise
                except Exception as e:  # noqa: BLE001 - returned: the caller decides
                    results[i] = e
        if not pending:
            return results
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if remaining == 0.0:
            raise CallTimeout(what, deadline_s, key, [f.name for f in pending.values()])
        _wait_any(list(pending.values()), 5.0 if remaining is None else min(remaining, 5.0))


def _wait_any(futures: list[Future], timeout: float) -> None:
    kinds = {type(f) for f in futures}
    (kinds.pop() if len(kinds) == 1 else Future).wait_any(futures, timeout)


# ---------------------------------------------------------------------------------------
# Ray
# ---------------------------------------------------------------------------------------
class RayFuture(Future):
    def __init__(self, ref, name: str = "?"):
        self.ref, self.name = ref, name

    def done(self) -> bool:
        import ray
        ready, _ = ray.wait([self.ref], timeout=0)
        return bool(ready)

    @staticmethod
    def wait_any(futures: list[Any], timeout: float) -> None:
        import ray
        ray.wait([f.ref for f in futures], num_returns=1, timeout=timeout)

    def result(self, timeout: float | None = None) -> Any:
        import ray
        try:
            return ray.get(self.ref, timeout=timeout)
        except ray.exceptions.RayActorError as e:
            raise ActorDied(str(e).splitlines()[0]) from e


class RayActor:
    def __init__(self, actor, name: str):
        self.actor, self.name = actor, name

    def call(self, method: str, *args, **kwargs) -> RayFuture:
        return RayFuture(getattr(self.actor, method).remote(*args, **kwargs), self.name)

    def kill(self) -> None:
        import ray
        ray.kill(self.actor, no_restart=True)


# ---------------------------------------------------------------------------------------
# Plain processes (GPU machine without Ray, and unit tests)
# ---------------------------------------------------------------------------------------
def _serve(conn, cls, args, kwargs, env):
    os.environ.update(env)
    try:
        obj = cls(*args, **kwargs)
        conn.send((0, True, None))
    except BaseException as e:  # noqa: BLE001 - report construction failures to the driver
        conn.send((0, False, _failure(e)))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        call_id, method, a, kw = msg
        try:
            conn.send((call_id, True, getattr(obj, method)(*a, **kw)))
        except BaseException as e:  # noqa: BLE001
            conn.send((call_id, False, _failure(e)))


def _failure(exc: BaseException) -> tuple[bytes | None, str]:
    """What a worker sends for a failed call: the pickled exception when it pickles, so the
    driver can catch it by type as under Ray, and the traceback text either way."""
    try:
        blob = pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - unpicklable arguments: the text still goes
        blob = None
    return blob, traceback.format_exc()


class ProcFuture(Future):
    def __init__(self, name: str = "?"):
        self._f: _CFuture = _CFuture()
        self.name = name

    def result(self, timeout: float | None = None) -> Any:
        return self._f.result(timeout)

    def done(self) -> bool:
        return self._f.done()

    @staticmethod
    def wait_any(futures: list[Any], timeout: float) -> None:
        concurrent.futures.wait([f._f for f in futures], timeout=timeout,
                                return_when=concurrent.futures.FIRST_COMPLETED)


class RemoteError(RuntimeError):
    """A worker's failure as text (`name: traceback`): raised as is when the exception did not
    survive pickling, else the `__cause__` of the worker's own exception."""


def _remote_exception(name: str, failure: tuple[bytes | None, str]) -> Exception:
    blob, text = failure
    remote = RemoteError(f"{name}: {text}")
    try:
        exc = pickle.loads(blob) if blob is not None else None
    except Exception:  # noqa: BLE001 - e.g. a class the driver cannot import
        exc = None
    if not isinstance(exc, Exception):  # SystemExit, KeyboardInterrupt: never re-raise those here
        return remote
    exc.__cause__ = remote
    return exc


class ProcActor:
    """One spawned process hosting `cls(*args)`; calls run one at a time, in order."""

    def __init__(self, cls, *args, name: str = "actor", env: dict[str, str] | None = None, **kwargs):
        ctx = mp.get_context("spawn")
        self.name = name
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, cls, args, kwargs, env or {}),
                                 name=name, daemon=False)
        self._proc.start()
        child.close()
        self._ids = itertools.count(1)
        self._pending: dict[int, ProcFuture] = {0: ProcFuture(name)}
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.ready = self._pending[0]

    def _read(self) -> None:
        while True:
            try:
                call_id, ok, value = self._conn.recv()
            except (EOFError, OSError):
                break
            fut = self._pending.pop(call_id)
            if ok:
                fut._f.set_result(value)
            else:
                fut._f.set_exception(_remote_exception(self.name, value))
        for fut in list(self._pending.values()):
            if not fut._f.done():
                fut._f.set_exception(ActorDied(f"{self.name} (pid {self._proc.pid}) died"))
        self._pending.clear()

    def call(self, method: str, *args, **kwargs) -> ProcFuture:
        fut = ProcFuture(self.name)
        with self._lock:
            call_id = next(self._ids)
            self._pending[call_id] = fut
            try:
                self._conn.send((call_id, method, args, kwargs))
            except (BrokenPipeError, OSError):
                self._pending.pop(call_id)
                fut._f.set_exception(ActorDied(f"{self.name} is not running"))
        return fut

    def kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(10)

    def close(self) -> None:
        try:
            self._conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()

"""Hosting plain worker classes as actors: in Ray, or in plain processes where Ray is absent.

The driver speaks one explicit vocabulary for both: `handle.call("method", *args)` returns a
`Future`; `wait_all(futures)` collects results. No decorators, no generated classes: a worker is
an ordinary Python class you can also instantiate in a debugger.

Failures look the same on both backends: an exception a worker method raises reaches the driver
as its own type (Ray: `RayTaskError` subclassing it; plain processes: the unpickled exception,
chained from a `RemoteError` holding the worker's traceback); a dead worker is `ActorDied`; a
`result(timeout)` that runs out is a `TimeoutError` (`ray.exceptions.GetTimeoutError` is one).
"""
from __future__ import annotations

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


class Future:
    def result(self, timeout: float | None = None) -> Any:  # pragma: no cover - interface
        raise NotImplementedError


def wait_all(futures: list[Future], timeout: float | None = None) -> list[Any]:
    """Every future's result, in order; `timeout` [s] bounds the whole wait (TimeoutError)."""
    if timeout is None:
        return [f.result() for f in futures]
    deadline = time.monotonic() + timeout
    return [f.result(max(0.0, deadline - time.monotonic())) for f in futures]


# ---------------------------------------------------------------------------------------
# Ray
# ---------------------------------------------------------------------------------------
class RayFuture(Future):
    def __init__(self, ref):
        self.ref = ref

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
        return RayFuture(getattr(self.actor, method).remote(*args, **kwargs))

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
    def __init__(self):
        self._f = _CFuture()

    def result(self, timeout: float | None = None) -> Any:
        return self._f.result(timeout)


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
        self._pending: dict[int, ProcFuture] = {0: ProcFuture()}
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
        fut = ProcFuture()
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

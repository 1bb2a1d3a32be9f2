"""Hosting plain worker classes as actors: in Ray, or in plain processes where Ray is absent.

The driver speaks one explicit vocabulary for both: `handle.call("method", *args)` returns a
`Future`; `wait_all(futures)` collects results. No decorators, no generated classes: a worker is
an ordinary Python class you can also instantiate in a debugger.
"""
from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import threading
import traceback
from concurrent.futures import Future as _CFuture
from typing import Any


class ActorDied(RuntimeError):
    """The process hosting an actor is gone (crash, OOM, kill -9)."""


class Future:
    def result(self, timeout: float | None = None) -> Any:  # pragma: no cover - interface
        raise NotImplementedError


def wait_all(futures: list[Future], timeout: float | None = None) -> list[Any]:
    return [f.result(timeout) for f in futures]


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
    except BaseException:  # noqa: BLE001 - report construction failures to the driver
        conn.send((0, False, traceback.format_exc()))
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
        except BaseException:  # noqa: BLE001
            conn.send((call_id, False, traceback.format_exc()))


class ProcFuture(Future):
    def __init__(self):
        self._f = _CFuture()

    def result(self, timeout: float | None = None) -> Any:
        return self._f.result(timeout)


class RemoteError(RuntimeError):
    pass


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
                fut._f.set_exception(RemoteError(f"{self.name}: {value}"))
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

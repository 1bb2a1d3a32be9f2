"""A reward worker: `python -m rl.rewards.worker FD DRIVER_PID`, started by `RewardPool`.

Imports the correctness function once (an import error goes back as a config error), warms
math-verify when it is `math`, then answers calls on the socket FD until it closes. A call's
exception, `sys.exit` included, is its outcome; anything that ends this process instead (a
segfault, `os._exit`, a hang the driver kills) the driver sees and counts. With the sandbox,
each call runs in a child process under `rl.rewards.sandbox`'s limits.
"""
from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection
from typing import Any, Callable


def _die_with(driver_pid: int) -> None:
    """Exit when the driver's process has ended (we were reparented), so that no worker, even
    one stuck in a call, outlives a driver killed without closing its pool. (Not
    PR_SET_PDEATHSIG: it fires when the driver *thread* that started us ends.)"""
    import threading
    import time

    def watch() -> None:
        while os.getppid() == driver_pid:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, name="driver-watch", daemon=True).start()


def _call(fn, response: str, answer: str, meta: dict) -> tuple[bool, object]:
    from rl.rewards.plugin import reward_value
    try:
        return True, reward_value(fn(response, answer, meta))
    except BaseException as e:  # sys.exit and KeyboardInterrupt too: a failed sample, no more
        return False, f"{type(e).__name__}: {e}"[:1000]


def start(fd: int, driver_pid: int, resolve: Callable[[str], Any]
          ) -> tuple[Connection, dict, Any] | None:
    """The start of a pool worker (this one and `rl.envs.worker`): leave stop signals to the
    driver, die with it, read the init message, take its `sys_path`, then `resolve` its
    `function` (imported after the path is set). Returns (connection, init, what `resolve`
    gave), or None once a `ConfigError` from `resolve` went back to the driver."""
    from rl.signals import shield_worker
    shield_worker()  # stop signals are the driver's; SIGTERM/SIGKILL still end a worker
    _die_with(driver_pid)
    conn = Connection(fd)
    init = conn.recv()
    sys.path[:] = init["sys_path"]
    from rl.config import ConfigError
    try:
        plugin = resolve(init["function"])
    except ConfigError as e:
        conn.send(("config_error", str(e)))
        return None
    conn.send(("imported",))
    return conn, init, plugin


def serve(conn: Connection, handle: Callable[..., tuple[bool, object]]) -> None:
    """Answer `(tag, *args)` calls with `("result", tag, *handle(*args))` until the driver
    closes the connection."""
    conn.send(("ready",))
    while True:
        try:
            tag, *args = conn.recv()
        except EOFError:
            return
        ok, value = handle(*args)
        conn.send(("result", tag, ok, value))


def _resolve(name: str):
    from rl.rewards.plugin import resolve_reward_function
    return resolve_reward_function(name)


def main(fd: int, driver_pid: int) -> None:
    started = start(fd, driver_pid, _resolve)
    if started is None:
        return
    conn, init, fn = started
    if init["function"] == "math":
        from rl.rewards.verifiers import math_equal
        math_equal("$\\frac{1}{2}$", "0.5")  # imports sympy, builds the LaTeX parser
        math_equal("$x^2+1$", "1+x^2")  # the first symbolic comparison fills sympy's caches
    if init["sandbox"] is None:
        serve(conn, lambda response, answer, meta: _call(fn, response, answer, meta))
        return
    from rl.rewards.sandbox import Sandbox
    sandbox = Sandbox(init["sandbox"], init["timeout_s"], init["protect"])
    serve(conn, lambda response, answer, meta: sandbox.call(fn, response, answer, meta))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))

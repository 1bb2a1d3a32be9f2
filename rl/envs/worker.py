"""An environment worker: `python -m rl.envs.worker FD DRIVER_PID`, started by `EnvPool`.

Imports the environment class once (an import error goes back as a config error), then answers
calls `(tag, row, state, message)` on the socket FD: the episode's pickled instance (`state`;
None for a new episode, built from `row`), one `step(message)`, and back `(ok, value)` with value
`(new state, (observation, reward, done))` or the error. Anything that ends this process (a
segfault, `os._exit`, a hang the driver kills) the driver sees and counts.
"""
from __future__ import annotations

import pickle
import sys
from multiprocessing.connection import Connection


def _step(cls, row: dict, state: bytes | None, message: dict) -> tuple[bool, object]:
    from rl.envs.protocol import Message, ToolCall, check_result
    try:
        env = cls(row) if state is None else pickle.loads(state)
        msg = Message(text=message["text"], turn=message["turn"],
                      truncated=message["truncated"],
                      tool_calls=[ToolCall(name=c["name"], arguments=c["arguments"])
                                  for c in message["tool_calls"]])
        result = check_result(env.step(msg))
        return True, (pickle.dumps(env), result)
    except BaseException as e:  # sys.exit and KeyboardInterrupt too: a failed episode, no more
        return False, f"{type(e).__name__}: {e}"[:1000]


def main(fd: int, driver_pid: int) -> None:
    from rl.rewards.worker import _die_with
    from rl.signals import shield_worker
    shield_worker()  # stop signals are the driver's; SIGTERM/SIGKILL still end a worker
    _die_with(driver_pid)
    conn = Connection(fd)
    init = conn.recv()
    sys.path[:] = init["sys_path"]
    from rl.config import ConfigError
    from rl.envs.protocol import load_environment
    try:
        cls = load_environment(init["function"])
    except ConfigError as e:
        conn.send(("config_error", str(e)))
        return
    conn.send(("imported",))
    conn.send(("ready",))
    while True:
        try:
            tag, row, state, message = conn.recv()
        except EOFError:
            return
        ok, value = _step(cls, row, state, message)
        conn.send(("result", tag, ok, value))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))

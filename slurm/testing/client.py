"""For what drives the test cluster from outside (tests/slurm, bench.topology_gpu): its client
environment, and polling."""
from __future__ import annotations

import time
from pathlib import Path


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.5):
    """`predicate()`'s first truthy value, polled every `poll_s`; TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)
    return value


def read_env_file(path: Path) -> dict[str, str]:
    """The variables start.sh's `env.sh` exports (SLURM_CONF, RL_SLURM_DIR)."""
    env = {}
    for line in path.read_text().splitlines():
        if line.startswith("export ") and "=" in line:
            key, value = line[len("export "):].split("=", 1)
            env[key] = value
    return env

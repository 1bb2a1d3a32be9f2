"""Polling, for what drives the test cluster from outside (tests/slurm, bench.topology_gpu)."""
from __future__ import annotations

import time


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.5):
    """`predicate()`'s first truthy value, polled every `poll_s`; TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)
    return value

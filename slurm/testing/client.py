"""For what drives the test cluster from outside (tests/slurm, bench.topology_gpu): its client
environment, and polling."""
from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Iterator
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


def kick_backfill_while_pending(job_id: str, stop: threading.Event, poll_s: float = 1.0) -> None:
    """Until `stop` is set: every `poll_s`, while job `job_id` (a component of it) is PENDING,
    touch a partition (`scontrol update PartitionName=batch State=UP`, which it already is), so
    that slurmctld's backfill scheduler runs again within a second.

    Only backfill starts a heterogeneous job, and Slurm 22.05's backfill runs only after some
    job, node, partition or reservation changed since its last pass. A requeued job may start
    again `cred_expire` + 1 s after the requeue: that moment changes nothing, so on this idle
    cluster the job waited for the next node ping to change something (20-40 s a requeue). On a
    real cluster something always changes. What the job does and which job Slurm starts are the
    same with or without this."""
    while not stop.wait(poll_s):
        states = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                                text=True).stdout.split()
        if "PENDING" in states:
            subprocess.run(["scontrol", "update", "PartitionName=batch", "State=UP"],
                           capture_output=True)


@contextlib.contextmanager
def backfill_kicked(job_id: str) -> Iterator[None]:
    """`kick_backfill_while_pending(job_id)` in a thread for the duration of the block."""
    stop = threading.Event()
    thread = threading.Thread(target=kick_backfill_while_pending, args=(job_id, stop),
                              daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)

"""Run one command and record its wall time and peak memory:
`python -m bench.measure_child OUT.json CMD [ARGS...]` (used by bench.export).

The command's output passes through. OUT.json gets its exit status, wall seconds, peak RSS
(`getrusage(RUSAGE_CHILDREN).ru_maxrss` once it has been waited for: this process has no other
child) and its peak anonymous and file-backed RSS (/proc/PID/status sampled every 20 ms).

Why a process of its own: Linux counts into a new process's ru_maxrss the memory of the process
it was forked from (the RSS at exec), so a child of a large process (the benchmark, with torch
and weights loaded) would report at least that process's size. This one imports nothing heavy.
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import threading
import time


def _rss_kib(pid: int) -> dict[str, int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            out[key] = int(value.split()[0])
    return out


def main() -> None:
    out, cmd = sys.argv[1], sys.argv[2:]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    peaks = {"RssAnon": 0, "RssFile": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for key, kib in _rss_kib(proc.pid).items():
                peaks[key] = max(peaks[key], kib)
            done.wait(0.02)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    rc = proc.wait()
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(out, "w") as f:
        json.dump({"rc": rc, "seconds": seconds, "maxrss_kib": usage.ru_maxrss,
                   "anon_kib": peaks["RssAnon"], "file_kib": peaks["RssFile"]}, f)


if __name__ == "__main__":
    main()

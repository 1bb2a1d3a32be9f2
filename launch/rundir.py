"""`--no-resume`: start a run over by moving its old run directory aside, never by ignoring it.

Ignoring it is what went wrong before: the old checkpoints stayed and retention (which keeps the
highest steps) deleted the new run's, the trajectory log refused steps older than its last, and
on Slurm the pickled "do not resume" flag made every requeued life start from step 0 again. With
the old run moved away, the job always resumes: the first life finds nothing and starts at step
0, and every later life of the same job resumes from its own checkpoints.
"""
from __future__ import annotations

import time
from pathlib import Path


def archive_run_dir(run_dir: Path, now: float | None = None) -> Path | None:
    """Rename an existing, non-empty `run_dir` to `<run_dir>.old-<UTC yyyymmdd-HHMMSS>` (a
    numbered suffix if that exists too) and return the new path; None when there is nothing to
    move. Nothing is deleted."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    target = run_dir.with_name(f"{run_dir.name}.old-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{n}")
    run_dir.rename(target)
    return target

"""The one reader of the Slurm job environment: every `SLURM_*` variable the suite uses is named
in `VARS` and read through `slurm_env` (submitit's `slurm.py` keeps one such table too)."""
from __future__ import annotations

import os
from typing import Mapping

VARS = {
    "job_id": "SLURM_JOB_ID",
    "restart_count": "SLURM_RESTART_COUNT",
    "het_size": "SLURM_HET_SIZE",
    "nodelist": "SLURM_JOB_NODELIST",
    "nodelist_het": "SLURM_JOB_NODELIST_HET_GROUP_{k}",
    "cpus_per_task": "SLURM_CPUS_PER_TASK",
    "cpus_per_task_het": "SLURM_CPUS_PER_TASK_HET_GROUP_{k}",
}
"""Our name -> the Slurm variable (`{k}`: a het group's index)."""


def slurm_env(name: str, k: int | None = None, environ: Mapping[str, str] | None = None
              ) -> str | None:
    """The value of `VARS[name]` (for het group `k`), None when unset or empty."""
    var = VARS[name].format(k=k) if k is not None else VARS[name]
    return (os.environ if environ is None else environ).get(var) or None


def job_id() -> str | None:
    """The job's id; None outside a Slurm job."""
    return slurm_env("job_id")


def restart_count() -> int:
    """How often Slurm has restarted this job (0 on its first run, and outside Slurm)."""
    return int(slurm_env("restart_count") or 0)

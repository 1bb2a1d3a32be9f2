"""Fixtures for the Slurm tests: one real single-machine cluster per session (reused if running).

`slurm_cluster` runs `slurm/testing/start.sh` (idempotent; installs Slurm with apt-get the first
time) and points this process's Slurm clients at it (`SLURM_CONF`). It does not stop the
cluster afterwards: the next session reuses it; `slurm/testing/stop.sh` stops it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from slurm.testing.client import read_env_file

REPO = Path(__file__).resolve().parents[2]
TESTING = REPO / "slurm" / "testing"
_NEEDED = ("munged", "slurmctld", "slurmd", "slurmdbd", "sbatch", "sacct", "mariadbd")


@dataclass(frozen=True)
class SlurmCluster:
    state_dir: Path
    env: dict[str, str]
    """What `env.sh` exports (SLURM_CONF, RL_SLURM_DIR)."""


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    if os.geteuid() != 0:
        pytest.skip("the Slurm test cluster needs root (network namespaces, daemons as root)")
    installed = all(shutil.which(b) or Path("/usr/sbin", b).exists() for b in _NEEDED)
    if not installed and shutil.which("apt-get") is None:
        pytest.skip("Slurm is not installed and there is no apt-get to install it")
    state_dir = Path(os.environ.get("RL_SLURM_DIR", "/tmp/rl-slurm"))
    proc = subprocess.run(["bash", str(TESTING / "start.sh")], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "RL_SLURM_DIR": str(state_dir)})
    if proc.returncode in (3, 4):  # not root / no apt-get (see start.sh)
        pytest.skip(f"cannot start the Slurm test cluster: {proc.stderr.strip()}")
    if proc.returncode != 0:
        pytest.fail(f"slurm/testing/start.sh failed ({proc.returncode}):\n"
                    f"{proc.stdout}\n{proc.stderr}")
    env = read_env_file(state_dir / "env.sh")
    os.environ.update(env)  # sbatch/sacct/scontrol from this process and submitit
    return SlurmCluster(state_dir=state_dir, env=env)

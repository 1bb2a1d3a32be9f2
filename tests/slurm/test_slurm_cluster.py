"""Against the real test cluster: a hetjob that runs Ray on 3 nodes, and a requeued job.

n1, n2 carry the feature `trainer`, n3 `rollout` (slurm/testing/start.sh), so the constraint
pins which node lands in which het group.
"""
import os
import subprocess
import time
from pathlib import Path

import pytest

from rl.config import SlurmGroupConfig
from slurm.executor import HetJobExecutor
from slurm.testing import probes
from slurm.testing.client import backfill_kicked

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[2]
_NET = os.environ.get("RL_SLURM_NET", "10.213.7")  # as in slurm/testing/config.sh
NODE_IPS = {"n1": f"{_NET}.11", "n2": f"{_NET}.12", "n3": f"{_NET}.13"}


def _executor(folder: Path, rollout_nodes: int = 1) -> HetJobExecutor:
    return HetJobExecutor(
        folder,
        trainer=SlurmGroupConfig(nodes=2, cpus_per_node=2, constraint="trainer", time_min=10),
        rollout=SlurmGroupConfig(nodes=rollout_nodes, cpus_per_node=3, constraint="rollout",
                                 time_min=10),
        signal_delay_s=30,
        setup=[f"export PYTHONPATH={REPO}"],
    )


def _final_sacct_state(job_id: str, timeout_s: float = 30) -> str:
    """The leader's state once sacct (slurmdbd) reports it final."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = subprocess.run(["sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", job_id],
                             capture_output=True, text=True, check=True).stdout
        states = dict(line.split("|", 1) for line in out.splitlines() if line)
        state = states.get(f"{job_id}+0", "")
        final = state not in ("", "PENDING", "RUNNING", "REQUEUED", "COMPLETING")
        if final or time.monotonic() > deadline:
            return state
        time.sleep(1)


@pytest.mark.timeout(420)  # includes the session fixture: apt-get + cluster start when cold
def test_hetjob_runs_ray_on_trainer_and_rollout_nodes(slurm_cluster, tmp_path):
    job = _executor(tmp_path / "jobs").submit(probes.ray_probe, str(tmp_path / "run"))
    try:
        out = job.result()
    except BaseException:
        job.cancel(check=False)  # leave no job behind on failure
        raise
    by_ip = {n["ip"]: n["resources"] for n in out["nodes"]}
    assert set(by_ip) == set(NODE_IPS.values())
    for name in ("n1", "n2"):
        assert by_ip[NODE_IPS[name]].get("trainer_node") == 1
        assert "rollout_node" not in by_ip[NODE_IPS[name]]
    assert by_ip[NODE_IPS["n3"]].get("rollout_node") == 1
    # Ray CPUs follow each het group's cpus_per_node (trainer 2, rollout 3)
    assert [by_ip[NODE_IPS[n]]["CPU"] for n in ("n1", "n2", "n3")] == [2, 2, 3]
    assert out["head"].startswith(NODE_IPS["n1"] + ":")
    assert out["trainer_task"]["ip"] in (NODE_IPS["n1"], NODE_IPS["n2"])
    assert out["rollout_task"] == {"ip": NODE_IPS["n3"], "host": "n3", "auth_mode": "token"}
    assert out["token_mode"] == "0o600"
    # Slurm's warning signal went to every step; all Ray nodes survived it
    assert out["alive_after_signal"] == 3 and out["rollout_after_signal"]["ip"] == NODE_IPS["n3"]
    assert _final_sacct_state(job.job_id) == "COMPLETED"
    # submitit's own watcher (sacct through the N+0 -> N mapping) agrees
    assert job.get_info(mode="force")["State"] == "COMPLETED" and job.done()
    print(f"ray up in {out['start_s']:.1f}s")


@pytest.mark.timeout(180)
def test_requeued_hetjob_restarts_and_returns_result(slurm_cluster, tmp_path):
    job = _executor(tmp_path / "jobs").submit(probes.requeue_probe, str(tmp_path))
    try:
        with backfill_kicked(job.job_id):  # the requeued life starts once eligible
            out = job.result()
    except BaseException:
        job.cancel(check=False)  # leave no job behind on failure
        raise
    assert out["restart_count"] == 1
    assert out["first_run"] == f"{job.job_id} n1"  # the first run really happened, same job id
    assert out["job_id"] == job.job_id and out["host"] == "n1"
    assert _final_sacct_state(job.job_id) == "COMPLETED"


@pytest.mark.timeout(180)
def test_preempted_hetjob_checkpoints_on_signal_and_resumes(slurm_cluster, tmp_path):
    # all 4 CPUs of n1..n3 in the low-priority `batch` partition ...
    ex = HetJobExecutor(
        tmp_path / "jobs",
        trainer=SlurmGroupConfig(nodes=2, cpus_per_node=4, constraint="trainer", time_min=10),
        rollout=SlurmGroupConfig(nodes=1, cpus_per_node=4, constraint="rollout", time_min=10),
        signal_delay_s=30, setup=[f"export PYTHONPATH={REPO}"])
    job = ex.submit(probes.preempt_probe, str(tmp_path))
    events = tmp_path / "events"
    try:
        deadline = time.monotonic() + 60
        while not (events.exists() and "start 0" in events.read_text()):
            assert time.monotonic() < deadline, "hetjob did not start"
            time.sleep(0.5)
        # ... so an `urgent` job on n1 preempts it: GraceTime + preempt_send_user_signal make
        # Slurm send the job's USR2 first; the job checkpoints and requeues itself.
        subprocess.run(["sbatch", "-p", "urgent", "-w", "n1", "-c", "1",
                        "-o", str(tmp_path / "urgent.out"), "--wrap", "sleep 2"],
                       check=True, capture_output=True)
        with backfill_kicked(job.job_id):
            out = job.result()
    except BaseException:
        job.cancel(check=False)
        raise
    assert out["restart_count"] == 1
    assert out["events"] == ["start 0", "checkpoint 0 SIGUSR2", "start 1"]
    assert _final_sacct_state(job.job_id) == "COMPLETED"

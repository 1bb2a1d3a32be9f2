"""Functions the Slurm tests submit as jobs: they live in an importable module because submitit
pickles functions by reference and the job's Python imports them again."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path



def ray_probe(run_dir: str) -> dict:
    """Starts Ray across the hetjob, places one task per node kind, reports what Ray saw.

    Returns {"nodes": [{"ip", "resources"}], "trainer_task": {...}, "rollout_task": {...},
    "token_mode": octal str, "start_s": float}.
    """
    import ray

    from slurm.ray_cluster import ROLLOUT_RESOURCE, TRAINER_RESOURCE, start_ray, stop_ray

    t0 = time.monotonic()
    cluster = start_ray(run_dir, timeout_s=150, object_store_bytes=80 * 2**20)
    start_s = time.monotonic() - t0
    try:
        @ray.remote(num_cpus=1)
        def where() -> dict:
            return {"ip": ray.util.get_node_ip_address(), "host": socket.gethostname(),
                    "auth_mode": os.environ.get("RAY_AUTH_MODE")}

        trainer = ray.get(where.options(resources={TRAINER_RESOURCE: 1}).remote(), timeout=60)
        rollout = ray.get(where.options(resources={ROLLOUT_RESOURCE: 1}).remote(), timeout=60)
        nodes = [{"ip": n["NodeManagerAddress"], "resources": n["Resources"]}
                 for n in ray.nodes() if n["Alive"]]
        # Slurm's warning signal reaches every step; Ray must survive it. This driver ignores
        # USR1 (submitit only handles USR2), then sends it to all steps of the job.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        subprocess.run(["scancel", "--signal=USR1", os.environ["SLURM_JOB_ID"]], check=True)
        time.sleep(3)
        alive_after_signal = sum(n["Alive"] for n in ray.nodes())
        rollout_after_signal = ray.get(
            where.options(resources={ROLLOUT_RESOURCE: 1}).remote(), timeout=60)
        return {"nodes": nodes, "trainer_task": trainer, "rollout_task": rollout,
                "head": cluster.address, "start_s": start_s,
                "alive_after_signal": alive_after_signal,
                "rollout_after_signal": rollout_after_signal,
                "token_mode": oct(cluster.token_path.stat().st_mode & 0o777)}
    finally:
        stop_ray(cluster)


def requeue_probe(marker_dir: str) -> dict:
    """First run: leaves a marker and requeues its own job; after the restart: reports."""
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    marker = Path(marker_dir) / "first_run"
    if restarts == 0:
        marker.write_text(f"{os.environ['SLURM_JOB_ID']} {socket.gethostname()}")
        subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True,
                       preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))
        time.sleep(300)  # Slurm kills us (TERM, then KILL after KillWait)
        raise RuntimeError("scontrol requeue did not stop the job")
    return {"restart_count": restarts, "first_run": marker.read_text(),
            "host": socket.gethostname(), "job_id": os.environ["SLURM_JOB_ID"]}


def preempt_probe(marker_dir: str) -> dict:
    """Waits to be preempted, then takes the production path of `slurm.allocation`: a stop signal
    (Slurm's USR2 via preempt_send_user_signal) -> "checkpoint" -> `requeue_self`. The restart
    reports. Events are appended to `marker_dir/events` (shared file system) for the test.

    (Not submitit's `Checkpointable`: its handler runs `scontrol requeue` with check_call, which
    fails when Slurm's own preemption requeue is already under way - a race seen in CI.)
    """
    from rl.signals import StopRequest
    from slurm.allocation import requeue_self
    stop = StopRequest().install()
    events = Path(marker_dir) / "events"
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    with events.open("a") as f:
        f.write(f"start {restarts}\n")
    if restarts == 0:
        deadline = time.monotonic() + 300
        while not stop.requested:
            if time.monotonic() > deadline:
                raise RuntimeError("no preemption signal arrived")
            time.sleep(0.2)
        with events.open("a") as f:
            f.write(f"checkpoint {restarts} {stop.signal_name}\n")
        requeue_self(os.environ["SLURM_JOB_ID"], restarts, 3, "preempted")
    return {"restart_count": restarts, "events": events.read_text().split("\n")[:-1]}


def stop_every_life_probe(cfg) -> dict:
    """`slurm.allocation.slurm_main` itself, with Ray and the RL loop replaced by a life that prints
    `life K` and stops "with a checkpoint" at once (the loop's `Requeue`). So slurm_main requeues
    the job while SLURM_RESTART_COUNT < cluster.max_requeues, then ends it with RequeueLimit:
    what `launch.submit --wait` follows, without minutes of Ray and vLLM start-up per life."""
    from types import SimpleNamespace

    import job.slurm_env
    import slurm.allocation
    from job.run import Requeue

    def run_job(cfg, resume, force, stop):
        life = job.slurm_env.restart_count()
        print(f"life {life} on {socket.gethostname()}", flush=True)
        stop.request("SIGUSR2")
        raise Requeue(f"stopped on SIGUSR2 at step {life + 1}")

    slurm.allocation._start_ray = lambda cfg: SimpleNamespace(address="none", nodes=[])  # type: ignore[assignment, misc]  # lint baseline (issue 39)
    slurm.allocation.stop_ray = lambda cluster: None  # type: ignore[assignment, misc]  # lint baseline (issue 39)
    slurm.allocation.run_job = run_job  # type: ignore[assignment]  # lint baseline (issue 39)
    return slurm.allocation.slurm_main(cfg)

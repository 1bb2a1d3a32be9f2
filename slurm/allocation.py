"""What the Slurm job runs (once, on the first trainer node): Ray across the allocation, the RL
job, and a requeue after a stop signal.

One life of the allocation:
 1. install the stop handlers (USR1/USR2/TERM/INT) before anything slow. They replace submitit's
    (its USR2 handler would requeue without our checkpoint; it ignores TERM);
 2. `start_ray(run_dir)`: the head here, a worker on every node of both het groups, per-job token;
 3. `job.run.run_job`: the loop, which resumes from the latest checkpoint if there is one;
 4. a stop signal makes the loop finish its step, checkpoint and raise `Requeue`. Then, while
    SLURM_RESTART_COUNT < cluster.max_requeues, `scontrol requeue` puts the same job id back in
    the queue and this process exits without a result (so submitit and `launch.submit --wait`
    keep waiting for the restart); past the limit the job ends with the outcome
    `requeue_limit` (`job.run.exit_status` turns it into EXIT_REQUEUE);
 5. any other error is a user error (config, data: raised, the job fails, nothing requeues) or a
    failure (`job.failures`: a crashed rank, a lost node, a call past its deadline, Ray that
    did not start): recorded, Ray stopped, then requeued the same way, sharing
    cluster.max_requeues; a crash loop (`cluster.max_failures_without_progress` failures in a
    row without a new checkpoint) ends the job with the outcome `crash_loop` (exit 1);
 6. Ray is stopped in every case.

SIGTERM (`scontrol requeue` from outside, preemption after its grace time, `scancel`) reaches every
step of the job at once: Ray dies with it and the checkpoint of the step in flight is usually not
written. The next start resumes from the last complete checkpoint (they are written atomically, and
the loop replays from there exactly). Such a life also ends without a result.

Every transition is an event in RUN_DIR/lifecycle.jsonl (`launch.status` reads it): `start`,
`stopped`, `failure`, `requeued` (reason: the signal, or `failure`), `requeue_limit`,
`crash_loop`, `interrupted`, `done`.
"""
from __future__ import annotations

import logging
import socket
import signal
import subprocess
import sys
import typing as tp

from job import slurm_env
from job.failures import is_failure, next_life, record_failure
from job.lifecycle import lifecycle
from job.rundir import RunDirBusy, RunDirLock
from job.run import Requeue, run_job
from rl.config import Config
from rl.signals import EXIT_REQUEUE, StopRequest
from slurm.ray_cluster import RayCluster, RayClusterError, start_ray, stop_ray

log = logging.getLogger(__name__)


class RequeueLimit(RuntimeError):
    """Stopped with a checkpoint, but the job was already requeued `cluster.max_requeues` times."""


def slurm_main(cfg: Config, resume: bool = True, force: bool = False) -> dict:
    """Runs the RL job inside the allocation; returns `run_job`'s summary dict when it finishes,
    the outcome {"status": "requeue_limit", "message"} when it stopped with a checkpoint or
    failed but may not requeue again, {"status": "crash_loop", "message"} when it failed
    again without progress (`job.failures`), or {"status": "busy", "message"} when another
    run holds the run directory (`job.rundir`; nothing started).

    Raises:
        SystemExit(EXIT_REQUEUE) after requeueing the job (after a stop or a failure), or when a
            signal interrupted the run (no result is pickled: the job comes back).
    """
    stop = StopRequest().install()
    try:  # one writer, taken before Ray puts its token file there; held until this process ends
        RunDirLock(cfg.run_dir).acquire()
    except RunDirBusy as e:
        print(e, file=sys.stderr, flush=True)
        return {"status": "busy", "message": str(e), "run_dir": str(cfg.run_dir)}
    job_id = slurm_env.job_id() or "?"
    restarts = slurm_env.restart_count()
    print(f"Slurm job {job_id}, restart {restarts}, driver on {socket.gethostname()}; "
          f"run directory {cfg.run_dir.resolve()}", flush=True)
    cluster = None
    try:
        cluster = _start_ray(cfg)
        stop.install()  # again: ray.init replaced the SIGTERM handler with sys.exit
        print(f"Ray up: head {cluster.address}, nodes "
              + ", ".join(f"{n.name}={n.ip} ({n.resource})" for n in cluster.nodes), flush=True)
        return run_job(cfg, resume, force, stop=stop)
    except Requeue as e:
        try:
            _check_requeue_limit(cfg, stop, job_id, restarts, str(e))
        except RequeueLimit as limit:  # an outcome for the launcher (`job.run.exit_status`)
            return {"status": "requeue_limit", "message": str(limit), "run_dir": str(cfg.run_dir)}
        # The event goes first: a preemption's SIGTERM (after GraceTime) may cut what follows.
        lifecycle(cfg, "requeued", reason=stop.signal_name, restart_count=restarts, job_id=job_id)
        stop_ray(cluster)  # before `scontrol requeue`, whose SIGTERM would kill Ray half-way
        cluster = None
        requeue_self(job_id, restarts, cfg.cluster.max_requeues, str(e))
    except Exception as e:  # noqa: BLE001 - a signal's doing, a failure, or raised
        if not stop.requested:
            if not is_failure(e):
                raise  # the user's to fix (config, data): no requeue
            stopping, cluster = cluster, None  # `_after_failure` stops it
            return _after_failure(cfg, e, job_id, restarts, stopping)
        # Most likely a SIGTERM: Slurm is ending every step, Ray included, so the checkpoint
        # could not be finished. Exit without a result; the restart resumes from the last one.
        lifecycle(cfg, "interrupted", reason=stop.signal_name, restart_count=restarts,
                  error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        print(f"interrupted by {stop.signal_name} ({type(e).__name__}); the next start resumes "
              "from the last complete checkpoint", flush=True)
        raise SystemExit(EXIT_REQUEUE) from e
    finally:
        if cluster is not None:
            stop_ray(cluster)


def _after_failure(cfg: Config, error: Exception, job_id: str, restarts: int,
                   cluster: RayCluster | None) -> dict:
    """Records the failure and stops Ray; then requeues the job (SystemExit) or, past
    cluster.max_requeues or in a crash loop, returns the outcome that ends it."""
    log.error("the run failed", exc_info=error)  # the whole traceback, in the job's log
    failure = record_failure(cfg, error, restarts)
    stop_ray(cluster)
    verdict = next_life(cfg, restarts, failure, verb="requeueing to resume")
    if not verdict.restart:  # `job.run.exit_status` prints the message
        lifecycle(cfg, verdict.outcome["status"], reason="failure", restart_count=restarts,
                  job_id=job_id)
        return verdict.outcome
    print(verdict.line, flush=True)
    lifecycle(cfg, "requeued", reason="failure", restart_count=restarts, job_id=job_id)
    requeue_self(job_id, restarts, cfg.cluster.max_requeues, verdict.line.split(";")[0])


def _start_ray(cfg: Config, attempts: int = 2) -> RayCluster:
    """`start_ray`, tried again once if a node did not come up.

    `ray start` gives a node's raylet a fixed 30 s to register with the head; on a node that is
    busy (or a slow shared file system importing Ray) it can miss that once, the head's own
    included (then its GCS never answers `ray.init`: `ray_cluster.connect`). `start_ray` tears
    a failed attempt down completely, so the second attempt starts clean.
    """
    store = cfg.cluster.ray_object_store_mb * 2**20 or None
    for attempt in range(1, attempts + 1):
        try:
            return start_ray(cfg.run_dir, timeout_s=cfg.cluster.ray_start_timeout_s,
                             object_store_bytes=store)
        except RayClusterError as e:
            if attempt == attempts:
                raise
            print(f"Ray did not start (attempt {attempt} of {attempts}): "
                  f"{str(e).splitlines()[0]}; trying again", flush=True)
    raise AssertionError("unreachable")


def _check_requeue_limit(cfg: Config, stop: StopRequest, job_id: str, restarts: int,
                         why: str) -> None:
    """Raises RequeueLimit (after recording it) when this job may not requeue itself again."""
    limit = cfg.cluster.max_requeues
    if restarts >= limit:
        lifecycle(cfg, "requeue_limit", reason=stop.signal_name, restart_count=restarts)
        raise RequeueLimit(
            f"{why}; not requeueing: job {job_id} was already requeued {restarts} times "
            f"(cluster.max_requeues={limit}). Submit the same config again to resume.")


def requeue_self(job_id: str, restarts: int, limit: int, why: str) -> tp.NoReturn:
    """`scontrol requeue` this job, then exit without a result (Slurm restarts the same job id)."""
    # The requeue terminates every process of the job, scontrol included: let it finish.
    proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True,
                          preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))
    if proc.returncode != 0:
        # e.g. a preemption that requeues the job itself is already under way
        print(f"scontrol requeue {job_id} failed ({proc.returncode}): {proc.stderr.strip()}; "
              "Slurm's own requeue (preemption) or a resubmission resumes the run", flush=True)
    else:
        print(f"{why}; requeued job {job_id} (restart {restarts + 1} of at most {limit})",
              flush=True)
    raise SystemExit(EXIT_REQUEUE)

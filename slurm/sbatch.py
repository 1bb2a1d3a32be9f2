"""`launch.submit` for `cluster.kind: slurm`: submit the run as one heterogeneous job.

`submit_slurm(cfg, args)` builds a `HetJobExecutor` from `cfg.cluster` (submitit folder
RUN_DIR/submitit), submits `slurm.allocation.slurm_main`, records the job in
RUN_DIR/slurm_job.json and prints where to watch it. By default it returns at once; with `--wait`
it follows the job through its requeues, streaming the job's output, and returns the run's exit
status (`wait_for`).

The memory plan check happens before, in `launch.submit` (`launch.plan.check_or_exit`).
"""
from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
from pathlib import Path

from job.rundir import RunDirLock
from rl.config import Config
from slurm.executor import HetJob, HetJobExecutor
from slurm.params import network_env

REPO = Path(__file__).resolve().parents[1]
JOB_FILE = "slurm_job.json"
_STATE_POLL_S = 10.0


def make_executor(cfg: Config, *, python: str | None = None, repo: Path = REPO) -> HetJobExecutor:
    """The executor for `cfg`: submitit folder RUN_DIR/submitit (no `%j`: see HetJobExecutor);
    the job runs `python` (default: this interpreter), imports the checkout at `repo`
    (PYTHONPATH) and runs in the submitting directory (sbatch's default)."""
    folder = cfg.run_dir.resolve() / "submitit"
    # NCCL / RDMA settings (cluster.network): exported here, they reach every srun step, the Ray
    # daemons that srun starts, and so every actor.
    network = [f"export {k}={shlex.quote(v)}"
               for k, v in sorted(network_env(cfg.cluster.network).items())]
    return HetJobExecutor.from_config(
        folder, cfg.cluster, job_name=cfg.name, python=python,
        setup=[f"export PYTHONPATH={repo}${{PYTHONPATH:+:$PYTHONPATH}}", *network])


def submit_slurm(cfg: Config, args: argparse.Namespace) -> int:
    """Submits the run; returns 0 (or, with `args.wait`, the run's exit status)."""
    from slurm.allocation import slurm_main

    executor = make_executor(cfg)
    # Always resume: `--no-resume` moved the old run aside before this (job.rundir), so the
    # first life starts at step 0 and every requeued life resumes from its own checkpoints.
    job = executor.submit(slurm_main, cfg, force=args.force)
    run_dir = cfg.run_dir.resolve()
    record = {"job_id": job.job_id, "submitted_at": time.time(), "folder": str(executor.folder),
              "stdout": str(job.paths.stdout), "stderr": str(job.paths.stderr)}
    (run_dir / JOB_FILE).write_text(json.dumps(record, indent=2) + "\n")
    RunDirLock(run_dir).reserve(job.job_id)  # the directory is the job's while it waits, too
    print(f"submitted Slurm job {job.job_id} ({cfg.cluster.trainer.nodes} trainer + "
          f"{cfg.cluster.rollout.nodes} rollout nodes)\n"
          f"  run directory: {run_dir}\n"
          f"  job output:    {job.paths.stdout}\n"
          f"  job errors:    {job.paths.stderr}\n"
          f"  status:        python -m launch.status {run_dir}\n"
          f"  TensorBoard:   tensorboard --logdir {run_dir / 'tensorboard'}", flush=True)
    if not getattr(args, "wait", False):
        return 0
    return wait_for(job)


def wait_for(job: HetJob) -> int:
    """Follows `job` (through requeues) until it ends, streaming its output; returns 0 when the run
    finished, EXIT_ABORTED when it aborted on non-finite steps, EXIT_REQUEUE when it stopped with a
    checkpoint and may not requeue again, else 1. Ctrl-C stops waiting, not the job."""
    from job.output import stream_errors, stream_output
    from job.run import exit_status

    interrupted = []
    signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
    out_pos = err_pos = 0
    last_poll = 0.0
    while not interrupted:
        out_pos = stream_output(job.paths.stdout, out_pos)
        err_pos = stream_errors(job.paths.stderr, err_pos)
        if job.paths.result_pickle.exists():
            break
        if time.monotonic() - last_poll > _STATE_POLL_S:
            # submitit's own refresh slows to one sacct call per 10 min on long jobs
            last_poll = time.monotonic()
            if job.watcher.is_done(job.job_id, mode="force"):
                time.sleep(2)  # let the output files settle
                break
        time.sleep(1)
    stream_output(job.paths.stdout, out_pos)
    stream_errors(job.paths.stderr, err_pos)
    if interrupted:
        print(f"\nstopped waiting; job {job.job_id} keeps running", flush=True)
        return 0
    try:
        result = job.result()  # the requeue limit is an outcome (`exit_status`), not an error
    except Exception:  # noqa: BLE001 - submitit wraps the job's exception in its own
        print(f"job {job.job_id} failed ({job.state}); full log: {job.paths.stderr}",
              file=sys.stderr, flush=True)
        return 1
    return exit_status(result)

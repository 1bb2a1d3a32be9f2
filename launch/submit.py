"""`python -m launch.submit CONFIG [key=value ...]`: run the RL job.

`cluster.kind: local` (the embedded default) runs it through submitit's local executor on this
machine with Ray started locally, streaming its progress; `cluster.kind: slurm` checks the memory
plan, submits a heterogeneous Slurm job (trainer group + rollout group, `slurm.submit`) and prints
where to watch it; with `--wait` it follows the job through its requeues instead.

Before anything starts, both refuse with one line and exit status 2 (`launch.checks`): a resume
whose config differs from RUN_DIR/config.yaml in keys that matter (`--force`, `--no-resume`), and
a malformed data row (`--no-data-check` for files only the job's nodes can read).
"""
from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from launch.checks import (check_data_or_exit, check_resume_or_exit,
                           check_slurm_params_or_exit)
from launch.common import (EXIT_USAGE, config_parser, fail, load_or_exit,
                           split_config_args)
from launch.rundir import archive_run_dir
from rl.console import job_log
from rl.signals import EXIT_REQUEUE


def _stream(path: Path, pos: int, quiet: bool = False, out=None) -> int:
    """Copies what `path` gained since `pos` to `out` (stdout); returns the new position.
    `quiet` drops submitit's own lines (job started, pickle loaded, job completed or failed)."""
    out = out or sys.stdout
    if path.exists():
        with open(path, "rb") as f:
            f.seek(pos)
            chunk = f.read()
        if quiet:  # only whole lines, so that a line cut by the read is judged once complete
            chunk = chunk[:chunk.rfind(b"\n") + 1]
        if chunk:
            text = chunk.decode(errors="replace")
            if quiet:  # run_local reports the outcome itself
                text = "".join(ln for ln in text.splitlines(keepends=True)
                               if not (ln.startswith("submitit INFO") or _JOB_FAILED in ln))
            out.write(text)
            out.flush()
            pos += len(chunk)
    return pos


def run_local(cfg, args) -> int:
    import submitit
    from launch.job import exit_status, run_job
    folder = cfg.run_dir / "submitit"
    folder.mkdir(parents=True, exist_ok=True)
    executor = submitit.LocalExecutor(folder=str(folder))
    executor.update_parameters(timeout_min=24 * 60)
    job = executor.submit(run_job, cfg, force=args.force)  # resumes whatever the run dir holds
    verbose = cfg.logging.verbose
    warm = "the SFT warm start (unless cached), then " if cfg.model.warm_start else ""
    print(f"local job {job.job_id} started in {cfg.run_dir.resolve()}: {warm}"
          f"{cfg.trainer.num_ranks} trainer rank(s) and {cfg.rollout.num_engines} "
          f"{cfg.rollout.engine} engine(s) start (minutes on a CPU)", flush=True)
    if not verbose:
        print(f"library output (vLLM, Ray, DeepSpeed, ...): {job_log(cfg.run_dir).resolve()} "
              "(logging.verbose=true prints it here)", flush=True)

    def forward(signum, _frame):  # Ctrl-C / TERM: ask the job to checkpoint and stop
        # submitit's local controller forwards SIGTERM to the task, where rl.signals handles it.
        print(f"\n{signal.Signals(signum).name}: asking the job to checkpoint and stop", flush=True)
        try:
            job._process.send_signal(signal.SIGTERM)
        except Exception:  # noqa: BLE001 - the job may already be gone
            pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, forward)
    def stream_err(pos: int) -> int:  # verbose: all of it, as the libraries wrote it
        return (_stream(job.paths.stderr, pos, out=sys.stderr) if verbose
                else _stream_errors(job.paths.stderr, pos))

    out_pos = err_pos = 0
    while not job.done():
        out_pos = _stream(job.paths.stdout, out_pos, quiet=not verbose)
        err_pos = stream_err(err_pos)
        time.sleep(0.5)
    _stream(job.paths.stdout, out_pos, quiet=not verbose)
    stream_err(err_pos)
    try:
        result = job.result()
    except Exception as e:  # noqa: BLE001 - submitit wraps the job's exception
        text = str(e)
        if "Requeue" in text:
            print("run stopped after writing a checkpoint; run the same command to resume", flush=True)
            return EXIT_REQUEUE
        if "ConfigError" in text:
            # the exception line, not a source line of the traceback (`raise ConfigError(...`)
            line = next((ln for ln in reversed(text.splitlines()) if "ConfigError:" in ln), text)
            fail("config error: " + line.split("ConfigError:", 1)[-1].strip())
        where = "" if verbose else f" and {job_log(cfg.run_dir)}"
        print(f"job failed; full log: {job.paths.stderr}{where}", file=sys.stderr)
        return 1
    return exit_status(result)


# Tracebacks run_local reports as one line itself (or that are no error at all).
_ONE_LINE_EXCEPTIONS = ("ConfigError", "Requeue")
_JOB_FAILED = "Submitted job triggered an exception"  # submitit's, before the traceback


def _stream_errors(path: Path, pos: int) -> int:
    """The errors in what the job's stderr gained since `pos`, printed to stderr: whole
    tracebacks (except those of _ONE_LINE_EXCEPTIONS) and other ERROR / `...Error:` lines.

    Returns the position to read from next: the end of the last complete line, or the start of
    a traceback whose exception line has not arrived yet (it is judged once complete).
    """
    if not path.exists():
        return pos
    with open(path, "rb") as f:
        f.seek(pos)
        chunk = f.read()
    done = offset = 0  # bytes judged; bytes read
    block = None  # the open traceback's lines
    for raw in chunk.split(b"\n")[:-1]:  # whole lines only (a progress bar's \r stays inside)
        offset += len(raw) + 1
        line = raw.decode(errors="replace").rstrip("\r")
        if block is not None:
            block.append(line)
            if not line or line[0].isspace():
                continue
            if not line.split(":", 1)[0].endswith(_ONE_LINE_EXCEPTIONS):
                print("\n".join(block), file=sys.stderr, flush=True)
            block = None
        elif line.startswith("Traceback"):
            block = [line]
            continue
        elif (line.startswith("ERROR") or "Error:" in line) and _JOB_FAILED not in line:
            print(line, file=sys.stderr, flush=True)
        done = offset
    return pos + done


def main(argv: list[str] | None = None) -> int:
    p = config_parser(__doc__)
    p.add_argument("--no-resume", action="store_true",
                   help="start over: move an existing run directory aside (RUN_DIR.old-TIME)")
    p.add_argument("--force", action="store_true", help="resume despite config differences")
    p.add_argument("--no-plan-check", action="store_true", help="skip the memory plan check")
    p.add_argument("--no-data-check", action="store_true",
                   help="skip reading the data files here (for files only the job's nodes can read)")
    p.add_argument("--wait", action="store_true",
                   help="Slurm: follow the job (through requeues) and stream its output; exit "
                        "status 0 when the run finished (a local run always waits)")
    args = split_config_args(p.parse_args(argv))
    cfg = load_or_exit(args.config_files, args.overrides)
    # Everything that can be refused is refused here, before Ray, engines or an allocation.
    check_slurm_params_or_exit(cfg)
    if not args.no_resume:
        check_resume_or_exit(cfg, args.force)
    if cfg.cluster.kind == "slurm" and not args.no_plan_check:  # a local CPU run has no GPU budget
        from launch.plan import check_or_exit
        check_or_exit(cfg, args.config)
    if not args.no_data_check:
        check_data_or_exit(cfg)
    from rl.data.datasets import eval_note
    if note := eval_note(cfg.data, cfg.seed):
        print(note, flush=True)
    if args.no_resume and (old := archive_run_dir(cfg.run_dir)) is not None:
        print(f"--no-resume: moved the previous run to {old}; starting over", flush=True)
    if cfg.cluster.kind == "local":
        return run_local(cfg, args)
    try:
        from slurm.submit import submit_slurm
    except ImportError as e:
        fail(f"cluster.kind: slurm needs the slurm package: {e}", EXIT_USAGE)
    return submit_slurm(cfg, args)


if __name__ == "__main__":
    sys.exit(main())

"""`launch.submit CONFIG --dry-run`: what a submission would do, without doing it.

After the same checks as a submission (`launch.submit.run_checks`; a refusal is the same one
line and exit status 2), prints the memory plan's verdict and step estimate, the run directory
and whether the job would resume there, what would be submitted, and the checks that could not
run on this machine and why. For `cluster.kind: slurm` that is the sbatch script itself, from
the executor a submission builds (`slurm.sbatch.make_executor`, `HetJobExecutor.
submission_text`: the same text `sbatch` would get); for `local`, what the local job starts.
Exit status 0. Nothing is submitted, and neither the run directory nor its submitit folder is
created.
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from launch.checks import Preflight
from launch.common import EXIT_USAGE, fail
from rl.config import Config


def _run_dir_line(cfg: Config, args: argparse.Namespace) -> str:
    run_dir = cfg.run_dir.resolve()
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return f"run directory: {run_dir} (new: the job starts at step 0)"
    if args.no_resume:
        return (f"run directory: {run_dir} (exists; --no-resume would move it to "
                f"{run_dir.name}.old-<UTC time> and start at step 0)")
    return f"run directory: {run_dir} (exists: the job would resume from its checkpoints)"


def print_dry_run(cfg: Config, args: argparse.Namespace, done: Preflight) -> int:
    """Prints the dry run of `cfg` (see the module doc); returns 0."""
    skipped = list(done.skipped)
    if cfg.model.path is not None and not (Path(cfg.model.path) / "config.json").is_file():
        why = f"model.path {cfg.model.path} is not on this machine"
        if done.plan is not None and done.plan.arch.source.startswith("known:"):
            why += (f" (the plan used the published config of "
                    f"{done.plan.arch.source.removeprefix('known:')}, rl/plan/known/)")
        skipped.insert(0, ("model checkpoint", why))
    lines = [f"dry run of {args.config}: nothing is submitted, no directory is created"]
    if done.plan is not None:
        from launch.plan import plan_line
        lines.append(plan_line(done.plan))
    lines.append(_run_dir_line(cfg, args))
    if cfg.cluster.kind == "slurm":
        try:
            from slurm.sbatch import make_executor
        except ImportError as e:  # as a submission says it
            fail(f"cluster.kind: slurm needs the slurm package: {e}", EXIT_USAGE)
        executor = make_executor(cfg)
        lines += ["", f"sbatch script ({cfg.cluster.trainer.nodes} trainer + "
                      f"{cfg.cluster.rollout.nodes} rollout node(s), one heterogeneous job; "
                      f"a submission writes it under {executor.folder}):",
                  executor.submission_text().rstrip("\n"), ""]
        if shutil.which("sbatch") is None:
            skipped.append(("sbatch", "not on PATH here: submit from a Slurm login node"))
    else:
        from launch.submit import local_description
        lines.append(f"local job (submitit's LocalExecutor on this machine, logs in "
                     f"{cfg.run_dir.resolve() / 'submitit'}): {local_description(cfg)}")
    lines.append(f"checks run: {', '.join(done.ran) or 'none'}")
    lines.append("checks not run here:" if skipped else "checks not run here: none")
    lines += [f"  {check}: {why}" for check, why in skipped]
    print("\n".join(lines), flush=True)
    return 0

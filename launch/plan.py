"""`python -m launch.plan CONFIG [key=value ...]`: will this run fit on its GPUs?

Prints, per GPU of the trainer group and of the rollout group, what the model's parameters,
gradients, optimizer state, activations, FP8/BF16 weights and KV cache take, a verdict per group
and suggestions, then an estimate of one RL step's time (rl/plan/timing.py). Reads the run
config and the model's config.json only (never weights), so a 284B model plans in well under a
second on a laptop. Exit status: 0 fits, 1 does not fit, 2 config error (one line on stderr),
unknown `cluster.slurm_params` included.

`--search` re-plans the same job in every layout (ZeRO stage, expert parallelism, optimizer and
parameter offload, rollout tensor parallelism; `rl/plan/search.py`) and prints those that fit,
fastest first, marking the ones that leave `--headroom` (default 5%) of every memory budget
free. Exit status 0 when one does, 1 when none does.
"""
from __future__ import annotations

import sys

from launch.checks import check_slurm_params_or_exit
from launch.common import (EXIT_USAGE, config_parser, fail, load_or_exit,
                           split_config_args)
from rl.config import Config, ConfigError
from rl.plan import PlanVerdict


def _verdict(cfg: Config, title: str):
    from rl.plan import check
    try:
        return check(cfg, title=title)
    except ConfigError as e:
        fail(f"config error: {e}")


def fitting_plan_or_exit(cfg: Config, title: str) -> PlanVerdict:
    """The plan of `cfg` when it fits; else print the report to stderr and exit 2."""
    verdict = _verdict(cfg, title)
    if not verdict.fits:
        print(verdict.report, file=sys.stderr)
        fail(f"{title}: refusing to submit, the memory plan above does not fit "
             "(fix the config or pass --no-plan-check)", EXIT_USAGE)
    return verdict


def plan_line(verdict: PlanVerdict) -> str:
    """One line: the verdict and the step-time estimate."""
    estimate = f", {verdict.time.summary}" if verdict.time is not None else ""
    return f"plan: FITS{estimate} (`python -m launch.plan` for the breakdown)"


def check_or_exit(cfg: Config, title: str) -> None:
    """For `launch.submit`: if the plan fits, print one line with the step-time estimate and
    return; else print the report to stderr and exit 2."""
    verdict = fitting_plan_or_exit(cfg, title)
    if verdict.time is not None:
        print(plan_line(verdict), file=sys.stderr)


def search_or_exit(cfg: Config, title: str, headroom: float) -> int:
    """Print the layout table; 0 when a layout leaves `headroom` free, else 1."""
    from rl.plan import arch, search, source
    try:
        search.require_gpus(cfg)  # before model_config: a preset would be built to read it
        config, where, _ = source.model_config(cfg)
        layouts = search.search(cfg, arch.parse(config, where))
    except ConfigError as e:
        fail(f"config error: {e}")
    text, best = search.report(title, layouts, headroom)
    print(text)
    return 0 if best is not None else 1


def main(argv: list[str] | None = None) -> int:
    p = config_parser(__doc__)
    p.add_argument("--search", action="store_true",
                   help="re-plan every layout (ZeRO stage, EP, offload, rollout TP) and print "
                        "those that fit, fastest first")
    p.add_argument("--headroom", type=float, default=0.05,
                   help="--search: fraction of every memory budget a layout must leave free "
                        "(default 0.05)")
    args = split_config_args(p.parse_args(argv))
    if not 0 <= args.headroom < 1:
        fail(f"config error: <command line>: --headroom {args.headroom}, expected a value in "
             "[0, 1)")
    cfg = load_or_exit(args.config_files, args.overrides)
    check_slurm_params_or_exit(cfg)  # the job would refuse them: so does the plan
    title = " ".join([args.config, *args.overrides])
    if args.search:
        return search_or_exit(cfg, title, args.headroom)
    verdict = _verdict(cfg, title)
    print(verdict.report)
    return 0 if verdict.fits else 1


if __name__ == "__main__":
    sys.exit(main())

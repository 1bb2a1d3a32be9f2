"""Dynamic sampling (DAPO) off vs on, same config: held-out accuracy per generated token.

    python -m bench.dynamic_sampling [--config configs/local.yaml] [--modes off on] [--seeds 0 ...]
                                     [--runs-dir DIR] [--name NAME] [--out DIR] [--smoke]
                                     [--combine RESULT.json ...] [KEY=VALUE overrides...]

Runs the real loop (`rl.loop.run`: DeepSpeed trainer, rollout engine, weight sync, evaluation)
once per seed and mode, one after the other in this process, on identical configs otherwise
(same data, warm start, learning-rate schedule): `off` is the config as given, `on` adds
`algorithm.dynamic_sampling=true`. Per run: the response tokens generated over the run (every
refill round included; `sampling/generated_tokens_total`), the held-out pass@1 curve against
them, warm-start and final accuracy (the mean of the last evaluations, as `make demo` reports),
the generation rounds, dropped and padded groups, and the step time. At equal generation cost:
`acc3_at_off_tokens` is the mean of the `on` run's last three evaluations within the `off` run's
whole token budget (same seed), to set against the `off` run's `final_mean_acc` (the `on` run is
then earlier in its learning-rate schedule). `--combine` writes one table from earlier result
files of this script (e.g. seeds run apart) without running anything.
Not measured: wall-clock per accuracy on separate devices (here both groups share the CPU).
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import device_info, load_run_config, parse_args, write_results

MODES = {"off": [], "on": ["algorithm.dynamic_sampling=true"]}


def _extra(parser) -> None:
    parser.add_argument("--config", default="configs/local.yaml")
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["off", "on"])
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="run seeds (default: the config's)")
    parser.add_argument("--combine", nargs="+", default=None,
                        help="merge these earlier result .json files instead of running")
    parser.add_argument("--runs-dir", default=None, help="keep the runs here (default: temp dir)")
    parser.add_argument("--name", default="dynamic_sampling",
                        help="result file name (<name>.json/.md)")
    parser.add_argument("overrides", nargs="*", help="dotted KEY=VALUE config overrides")


SMOKE = ["num_steps=3", "algorithm.prompts_per_step=8", "rollout.n_samples=4",
         "rollout.max_new_tokens=6", "eval.every=3", "eval.num_prompts=16", "eval.pass_k=1",
         "checkpoint.every=0", "trainer.num_ranks=1", "trainer.zero_stage=2",
         # The smoke checks the bench's own code: the cheap engine, no SFT warm start.
         "rollout.engine=hf", "model.warm_start=false"]


def run_mode(cfg_path: str, overrides: list[str], mode: str, seed: int, out_dir: Path) -> dict:
    from rl.config import load_config
    from rl.loop import run
    cfg = load_config(cfg_path, [*overrides, *MODES[mode], f"seed={seed}", f"output_dir={out_dir}",
                                 f"name=dynamic-sampling-{mode}-seed{seed}"])
    t0 = time.perf_counter()
    result = run(cfg, resume=False)
    wall = time.perf_counter() - t0
    h, P = result.history, cfg.algorithm.prompts_per_step
    tokens = [m["sampling/generated_tokens_total"] for m in h]
    timed = [m for m in h[1:] if "eval/pass1" not in m] or h
    return {
        "mode": mode, "seed": seed, "steps": result.step, "wall_s": wall,
        "step_s": statistics.median(m["time/step"] for m in timed),
        "rollout_s": statistics.median(m["time/rollout"] for m in timed),
        "generated_tokens": tokens[-1] if tokens else 0,
        "trained_tokens": sum(m["rollout/response_length"] * P * cfg.rollout.n_samples
                              for m in h),
        "gen_rounds_mean": statistics.fmean(m["sampling/gen_rounds"] for m in h),
        "dropped_groups": sum(m["sampling/dropped_groups"] for m in h),
        "padded_groups": sum(m["sampling/padded_groups"] for m in h),
        # of every prompt group generated, the share whose rewards were all equal
        "zero_spread_share": sum(m["sampling/dropped_groups"] + m["reward/zero_std_frac"] * P
                                 for m in h) / max(sum(m["sampling/dropped_groups"] + P
                                                       for m in h), 1),
        "warm_acc": result.warm_start_accuracy, "final_acc": result.final_accuracy,
        "final_mean_acc": result.final_mean_accuracy,
        "gain": (None if result.final_mean_accuracy is None or result.warm_start_accuracy is None
                 else result.final_mean_accuracy - result.warm_start_accuracy),
        # [step, generated tokens so far, held-out pass@1]
        "eval_curve": [[m["step"], m["sampling/generated_tokens_total"], m["eval/pass1"]]
                       for m in h if "eval/pass1" in m],
        "reward_curve": [round(m["sampling/reward_mean"], 4) for m in h],
    }


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], _extra)
    overrides = list(args.overrides) + (SMOKE if args.smoke else [])
    if args.combine:
        files = [json.loads(Path(path).read_text()) for path in args.combine]
        combined = [r for f in files for r in f["rows"] if r.get("seed") is not None]
        _write(args, overrides, combined, [f"combined from: {f['date']} on {f['device']}, "
                                       f"`{f['command']}`" for f in files])
        return 0
    cfg = load_run_config(args.config, overrides)
    root = Path(args.runs_dir) if args.runs_dir else Path(tempfile.mkdtemp(prefix="bench-dyn-"))
    runs: list[dict] = []
    for seed in args.seeds if args.seeds is not None else [cfg.seed]:
        for mode in args.modes:
            print(f"== seed {seed}, dynamic sampling {mode}", flush=True)
            runs.append(run_mode(args.config, overrides, mode, seed, root))
            _write(args, overrides, runs)  # after each run: a bench cut short keeps the rest
    return 0


def _compare(rows: list[dict]) -> None:
    """Each `on` row against the `off` row of its seed: tokens and accuracy at equal tokens."""
    for r in rows:
        off = next((o for o in rows if o["mode"] == "off" and o["seed"] == r["seed"]), None)
        r["tokens_vs_off"] = r["generated_tokens"] / off["generated_tokens"] if off else None
        within = [e[2] for e in r["eval_curve"] if off and e[1] <= off["generated_tokens"]]
        r["acc3_at_off_tokens"] = (statistics.fmean(within[-3:])
                                   if within and r["mode"] == "on" else None)


def _means(rows: list[dict]) -> list[dict]:
    """One row per mode: the mean over seeds of each number."""
    out = []
    for mode in sorted({r["mode"] for r in rows}, key=list(MODES).index):
        mine = [r for r in rows if r["mode"] == mode]
        row: dict = {"mode": f"{mode} (mean of {len(mine)})", "seed": None}
        for key in ("generated_tokens", "tokens_vs_off", "zero_spread_share", "gen_rounds_mean",
                    "dropped_groups", "padded_groups", "warm_acc", "final_mean_acc", "gain",
                    "acc3_at_off_tokens", "step_s", "rollout_s"):
            values = [r[key] for r in mine if r.get(key) is not None]
            row[key] = statistics.fmean(values) if values else None
        out.append(row)
    return out


def _write(args, overrides: list[str], runs: list[dict], sources: list[str] | None = None
           ) -> None:
    rows = [dict(r) for r in runs]
    _compare(rows)
    if len({r["seed"] for r in rows}) > 1:
        rows += _means(rows)
    name = f"{args.name}_smoke" if args.smoke else args.name
    notes = [f"config {args.config} {' '.join(overrides)}",
             "generated_tokens: response tokens over the run, every refill round included; "
             "step_s / rollout_s: median over steps without evaluation, first step excluded; "
             "final_mean_acc: mean held-out pass@1 of the last 3 evaluations (as make demo); "
             "acc3_at_off_tokens: the same for the on run's evaluations within the off run's "
             "token budget (same seed)", *(sources or [])]
    for r in rows:
        if "eval_curve" in r:
            notes.append(f"seed {r['seed']} {r['mode']}: held-out pass@1 by [step, generated "
                         f"tokens, pass@1] {r['eval_curve']}")
    write_results(name, args.out, device_info(), rows,
                  ["mode", "seed", "steps", "generated_tokens", "tokens_vs_off",
                   "zero_spread_share", "gen_rounds_mean", "dropped_groups", "padded_groups",
                   "warm_acc", "final_mean_acc", "gain", "acc3_at_off_tokens", "step_s",
                   "rollout_s", "wall_s"], notes)


if __name__ == "__main__":
    raise SystemExit(main())

"""On-policy vs bounded-staleness RL, same config, same run: step time, idle ratios, accuracy.

    python -m bench.async_rl [--config configs/local.yaml] [--staleness 0 1] [--out DIR]
                             [--smoke] [KEY=VALUE overrides...]

Runs the real loop (`rl.loop.run`: DeepSpeed trainer, rollout engine, weight sync, evaluation)
once per `algorithm.max_staleness` value, one after the other in this process, on identical
configs otherwise (same seed, data, warm start). Per mode it reports the median step time (steps
without evaluation, first step excluded), the mean idle ratio of each group, and the warm-start
and final held-out accuracy with the eval curve. The reference rows:
  - `on-policy` (max_staleness 0): rollout then train, the naive schedule;
  - `perfect overlap`: the physical limit of overlapping them, computed from the on-policy run's
    own phases: median over steps of max(rollout, train) + reward + sync.
On a GPU host with 2 GPUs and no Ray, the trainer takes GPU0 and the rollout engine GPU1; with
one GPU both share it (`sync.backend: auto` syncs over CUDA IPC there).
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from bench.common import device_info, load_run_config, parse_args, write_results


def _extra(parser) -> None:
    parser.add_argument("--config", default="configs/local.yaml")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--runs-dir", default=None, help="keep the runs here (default: temp dir)")
    parser.add_argument("--name", default="async_rl", help="result file name (<name>.json/.md)")
    parser.add_argument("overrides", nargs="*", help="dotted KEY=VALUE config overrides")


SMOKE = ["num_steps=4", "algorithm.prompts_per_step=8", "rollout.n_samples=4",
         "rollout.max_new_tokens=6", "eval.every=0", "eval.num_prompts=16", "eval.pass_k=2",
         "checkpoint.every=0", "trainer.num_ranks=1", "trainer.zero_stage=2",
         # The smoke checks the bench's own code: the cheap engine, no SFT warm start.
         "rollout.engine=hf", "model.warm_start=false"]


def _median_step(history: list[dict], key: str = "time/step") -> float:
    steps = [h for h in history[1:] if "eval/pass1" not in h] or history
    return statistics.median(h[key] for h in steps)


def run_mode(cfg_path: str, overrides: list[str], staleness: int, out_dir: Path) -> dict:
    from rl.config import load_config
    from rl.loop import run
    cfg = load_config(cfg_path, [*overrides, f"algorithm.max_staleness={staleness}",
                                 f"output_dir={out_dir}", f"name=staleness-{staleness}"])
    t0 = time.perf_counter()
    result = run(cfg, resume=False)
    wall = time.perf_counter() - t0
    h = result.history
    phases = [max(m["time/rollout"], m["time/train"]) + m["time/reward"] + m["time/sync"]
              for m in h[1:] if "eval/pass1" not in m] or [0.0]
    return {
        "mode": "on-policy" if staleness == 0 else f"max_staleness {staleness}",
        "staleness": staleness, "steps": result.step, "wall_s": wall,
        "step_s": _median_step(h),
        "rollout_s": _median_step(h, "time/rollout"), "train_s": _median_step(h, "time/train"),
        "sync_s": _median_step(h, "time/sync"),
        "trainer_idle": statistics.fmean(m["trainer/idle_ratio"] for m in h[1:] or h),
        "rollout_idle": statistics.fmean(m["rollout/idle_ratio"] for m in h[1:] or h),
        "staleness_mean": statistics.fmean(m["rollout/staleness_mean"] for m in h),
        "warm_acc": result.warm_start_accuracy, "final_acc": result.final_accuracy,
        # The demo's learning figure: the mean of the last evaluations (three by default).
        "final_mean_acc": result.final_mean_accuracy,
        "gain": (None if result.final_mean_accuracy is None or result.warm_start_accuracy is None
                 else result.final_mean_accuracy - result.warm_start_accuracy),
        "eval_curve": [[m["step"], m["eval/pass1"]] for m in h if "eval/pass1" in m],
        "reward_curve": [round(m["reward/mean"], 4) for m in h],
        "overlap_limit_s": statistics.median(phases),
    }


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], _extra)
    overrides = list(args.overrides) + (SMOKE if args.smoke else [])
    load_run_config(args.config, overrides)  # checks, and Ray for the runs below
    root = Path(args.runs_dir) if args.runs_dir else Path(tempfile.mkdtemp(prefix="bench-async-"))
    runs: list[dict] = []
    for s in args.staleness:
        print(f"== max_staleness {s}", flush=True)
        runs.append(run_mode(args.config, overrides, s, root))
        _write(args, overrides, runs)  # after each mode: a run cut short keeps what it measured
    return 0


def _write(args, overrides: list[str], runs: list[dict]) -> None:
    rows = [dict(r) for r in runs]
    base = next((r for r in rows if r["staleness"] == 0), None)
    if base is not None:
        for r in rows:
            r["step_vs_on_policy"] = r["step_s"] / base["step_s"]
        rows.append({"mode": "perfect overlap (limit)", "step_s": base["overlap_limit_s"],
                     "step_vs_on_policy": base["overlap_limit_s"] / base["step_s"]})
    name = f"{args.name}_smoke" if args.smoke else args.name
    notes = [f"config {args.config} {' '.join(overrides)}",
             "step time: median over steps without evaluation, first step excluded; idle "
             "ratios: mean over steps 2..N (rollout/idle_ratio, trainer/idle_ratio)",
             "perfect overlap: the on-policy run's median max(rollout, train) + reward + sync"]
    for r in rows:
        if "eval_curve" in r:
            notes.append(f"{r['mode']}: held-out pass@1 by step {r['eval_curve']}")
    write_results(name, args.out, device_info(), rows,
                  ["mode", "step_s", "step_vs_on_policy", "rollout_s", "train_s", "sync_s",
                   "trainer_idle", "rollout_idle", "staleness_mean", "warm_acc", "final_acc",
                   "final_mean_acc", "gain", "wall_s"], notes)


if __name__ == "__main__":
    raise SystemExit(main())

"""The tool-use demo's figures from its run directory: `python -m bench.tools_demo RUN_DIR
--seed N --wall-s S --date D --device TEXT [--note TEXT]` puts the run's row into
bench/results/tools_demo.json (one row per seed; a seed's earlier row is replaced).

Held-out greedy accuracy and tool-call rate of the warm start (step 0) and of the last
evaluation (`eval/pass1`, `eval/tool_call_rate`, from TensorBoard: the step-0 evaluation is not
in metrics.jsonl), the mean of the last evaluations, the training tool-call rate and reward of
the first and last ten steps. It runs nothing."""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from launch.inspect import read_scalars
from rl.evaluate import mean_of_last_evals, read_metrics_jsonl

OUT = Path(__file__).resolve().parent / "results"


def figures(run_dir: Path) -> dict:
    tb = run_dir / "tensorboard"
    acc, calls = dict(read_scalars(tb, "eval/pass1")), dict(read_scalars(tb, "eval/tool_call_rate"))
    rows = read_metrics_jsonl(run_dir / "metrics.jsonl")
    steps = sorted(acc)
    mean_last, last_steps = mean_of_last_evals([{"step": s, "eval/pass1": acc[s]} for s in steps])

    def mean(key, part):
        return round(statistics.fmean(r[key] for r in part), 3)
    return {"warm_acc": round(acc[0], 3), "final_acc": round(acc[steps[-1]], 3),
            "final_step": steps[-1], "mean_last_evals": round(mean_last or 0.0, 3),
            "mean_last_steps": last_steps,
            "gain_points": round(100 * ((mean_last or 0.0) - acc[0]), 1),
            "warm_tool_call_rate": round(calls[0], 3),
            "final_tool_call_rate": round(calls[steps[-1]], 3),
            "eval_curve": [[s, round(acc[s], 3), round(calls[s], 3)] for s in steps],
            "train_tool_call_rate_first10": mean("env/tool_call_rate", rows[:10]),
            "train_tool_call_rate_last10": mean("env/tool_call_rate", rows[-10:]),
            "train_reward_first10": mean("reward/mean", rows[:10]),
            "train_reward_last10": mean("reward/mean", rows[-10:]),
            "env_failures": rows[-1]["env/failures"], "steps": rows[-1]["step"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.tools_demo", description=__doc__.split("\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--seed", type=int, default=0, help="the run's `seed`")
    p.add_argument("--wall-s", type=float, required=True, help="the run's wall time [s]")
    p.add_argument("--date", required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--note", default="")
    args = p.parse_args(argv)
    row = {"seed": args.seed, **figures(args.run_dir), "wall_s": round(args.wall_s),
           "device": args.device, "date": args.date, "note": args.note}
    path = OUT / "tools_demo.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    rows = sorted([r for r in rows if r["seed"] != args.seed] + [row], key=lambda r: r["seed"])
    doc = {"what": "the tool-use demo (configs/local_tools.yaml): held-out greedy accuracy and "
                   "tool-call rate on 300 two-digit products, warm start vs the last evaluations",
           "command": "python -m launch.submit configs/local_tools.yaml seed=N", "rows": rows}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()

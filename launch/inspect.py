"""Summarise a run directory: `python -m launch.inspect RUN_DIR [--samples N] [--tokenizer PATH] [--ids] [--plot]`.

Prints, from `RUN_DIR/trajectories.h5`, the row and step counts and one line per step (mean
reward, response length, weight versions), then a few samples decoded with the run's own
tokenizer, a multi-turn one turn by turn with its tool calls and observations
(`--tokenizer PATH`, else `RUN_DIR/model` when it exists, else the model directory the
run started from, found from `RUN_DIR/config.yaml`: its SFT warm start or its model; token ids
when none loads, or with `--ids`), and the last eval accuracy from `RUN_DIR/tensorboard`.
`--plot` writes `RUN_DIR/curves.png`: reward per step and eval/pass1. Works on a live run
(best-effort reads). Leaves out: building anything (a missing warm start is not trained).

Exit status: 0 on success, 2 when RUN_DIR is missing or holds neither a trajectory file nor
TensorBoard events (one line on stderr).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rl.metrics.tensorboard import TENSORBOARD_SUBDIR
from rl.metrics.trajectories import TRAJECTORY_FILE, TrajectoryFileError, TrajectoryReader

EVAL_TAG = "eval/pass1"


class InspectError(ValueError):
    """A problem with the run directory; reported as one line, exit status 2."""


def read_scalars(tb_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) pairs of `tag` from the event files under `tb_dir`, purges applied."""
    if not tb_dir.is_dir():
        return []
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})  # 0 = keep every point
    acc.Reload()
    if tag not in acc.Tags().get("scalars", []):
        return []
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _load_tokenizer(path: Path | None) -> Any | None:
    if path is None:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # decoding is optional: say why and print ids instead
        print(f"(no tokenizer from {path}: {type(e).__name__}: {str(e).splitlines()[0][:120]}; "
              "printing token ids)")
        return None


def run_tokenizer_dir(run_dir: Path) -> Path | None:
    """The model directory the run started from (holding its tokenizer), or None.

    Found from RUN_DIR/config.yaml (`rl.sft.find_run_model_dir`); when no candidate directory
    exists, the path as named (`_load_tokenizer` then says it found no tokenizer there).
    """
    from rl.sft import find_run_model_dir
    named, found = find_run_model_dir(run_dir)
    return found or named


def _text(tokenizer: Any | None, ids: Any) -> str:
    if tokenizer is None:
        return "ids " + " ".join(str(int(t)) for t in ids)
    return repr(tokenizer.decode([int(t) for t in ids]))


def summarize(reader: TrajectoryReader, num_samples: int, tokenizer: Any | None) -> list[str]:
    lines = [f"trajectories: {reader.num_rows} rows, {len(reader.steps())} steps"]
    if reader.num_rows == 0:
        return lines
    lines.append(f"{'step':>6} {'rows':>6} {'reward':>8} {'std':>7} {'resp_len':>8} "
                 f"{'trunc':>6} {'weights':>9}")
    for s in reader.step_summaries():
        versions = (str(s.weight_version_min) if s.weight_version_min == s.weight_version_max
                    else f"{s.weight_version_min}-{s.weight_version_max}")
        lines.append(f"{s.step:>6} {s.num_rows:>6} {s.reward_mean:>8.4f} {s.reward_std:>7.4f} "
                     f"{s.response_length_mean:>8.1f} {s.truncated_frac:>6.2f} {versions:>9}")
    # The last rows are the most recent policy: the most interesting ones to read.
    first = max(0, reader.num_rows - num_samples)
    for i in range(first, reader.num_rows):
        row = reader.row(i)
        lines.append(f"-- row {i}: step {row['step']}, weights v{row['weight_version']}, prompt "
                     f"{row['prompt_index']}#{row['sample_index']}, reward {row['reward']:.3f}, "
                     f"advantage {row['advantage']:+.3f}, finish {row['finish_reason']}")
        lines.append(f"   prompt:   {_text(tokenizer, row['prompt_ids'])}")
        if row.get("episode"):
            lines += _episode_lines(row, tokenizer)
        else:
            lines.append(f"   response: {_text(tokenizer, row['response_ids'])}")
    return lines


def _episode_lines(row: dict, tokenizer: Any | None) -> list[str]:
    """A multi-turn row: each model turn, its tool calls and the observation that followed (the
    environment's tokens: context, masked out of the loss)."""
    ep, ids = row["episode"], row["response_ids"]
    mask = row.get("loss_mask")
    env = int(len(mask) - mask.sum()) if mask is not None and len(mask) else 0
    out = [f"   episode:  {len(ep['turns'])} turns, {env} environment tokens (masked)"
           + (f", environment failed: {ep['error']}" if ep.get("error") else "")]
    for k, turn in enumerate(ep["turns"], 1):
        out.append(f"   turn {k}:   {_text(tokenizer, ids[turn['start']:turn['end']])}")
        for name, args in turn["tool_calls"]:
            out.append(f"     tool call: {name}({args!r})")
        if turn["observation"] is not None:
            out.append(f"     observation: {turn['observation']!r}")
    return out


def plot(run_dir: Path, reader: TrajectoryReader | None, evals: list[tuple[int, float]]) -> Path:
    """Write `run_dir/curves.png`: reward mean +- std per step, and eval/pass1 per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_e) = plt.subplots(1, 2, figsize=(10, 4))
    summaries = reader.step_summaries() if reader is not None else []
    if summaries:
        steps = [s.step for s in summaries]
        mean = [s.reward_mean for s in summaries]
        std = [s.reward_std for s in summaries]
        ax_r.plot(steps, mean, marker=".", label="mean")
        ax_r.fill_between(steps, [m - d for m, d in zip(mean, std)],
                          [m + d for m, d in zip(mean, std)], alpha=0.2, label="+-std")
        ax_r.legend()
    else:
        ax_r.text(0.5, 0.5, "no trajectories", ha="center", va="center", transform=ax_r.transAxes)
    ax_r.set(title="rollout reward", xlabel="step", ylabel="reward")
    if evals:
        ax_e.plot([s for s, _ in evals], [v for _, v in evals], marker="o")
    else:
        ax_e.text(0.5, 0.5, f"no {EVAL_TAG} scalars", ha="center", va="center",
                  transform=ax_e.transAxes)
    ax_e.set(title=EVAL_TAG, xlabel="step", ylabel="accuracy")
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = run_dir / "curves.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def run(run_dir: Path, num_samples: int, tokenizer_path: Path | None, make_plot: bool,
        ids: bool = False) -> None:
    if not run_dir.is_dir():
        raise InspectError(f"{run_dir}: no such run directory")
    traj_path, tb_dir = run_dir / TRAJECTORY_FILE, run_dir / TENSORBOARD_SUBDIR
    if not traj_path.exists() and not tb_dir.is_dir():
        raise InspectError(f"{run_dir}: not a run directory (neither {TRAJECTORY_FILE} nor "
                           f"{TENSORBOARD_SUBDIR}/ found)")
    reader = None
    try:
        if traj_path.exists():
            reader = TrajectoryReader(traj_path)
            if tokenizer_path is None and (run_dir / "model").exists():
                tokenizer_path = run_dir / "model"
            if tokenizer_path is None and num_samples > 0 and not ids:
                tokenizer_path = run_tokenizer_dir(run_dir)
            tokenizer = None
            if num_samples > 0 and not ids:
                tokenizer = _load_tokenizer(tokenizer_path)
                if tokenizer is not None:
                    print(f"(decoded with the tokenizer in {tokenizer_path}; --ids prints token ids)")
            print("\n".join(summarize(reader, num_samples, tokenizer)))
        else:
            print(f"trajectories: none ({TRAJECTORY_FILE} not found)")
        evals = read_scalars(tb_dir, EVAL_TAG)
        if evals:
            step, value = evals[-1]
            print(f"{EVAL_TAG}: {len(evals)} evaluations, last {value:.4f} at step {step}")
        else:
            print(f"{EVAL_TAG}: no evaluations logged")
        if make_plot:
            print(f"wrote {plot(run_dir, reader, evals)}")
    except TrajectoryFileError as e:
        raise InspectError(str(e)) from None
    finally:
        if reader is not None:
            reader.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.inspect", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run directory (output_dir/name)")
    parser.add_argument("--samples", type=int, default=3, help="samples to print (the last rows)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="tokenizer directory for decoding (default: RUN_DIR/model if present, "
                             "else the run's own model directory from RUN_DIR/config.yaml)")
    parser.add_argument("--ids", action="store_true", help="print token ids, not decoded text")
    parser.add_argument("--plot", action="store_true", help="write RUN_DIR/curves.png")
    args = parser.parse_args(argv)
    try:
        run(args.run_dir, max(0, args.samples), args.tokenizer, args.plot, args.ids)
    except InspectError as e:
        print(f"inspect: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

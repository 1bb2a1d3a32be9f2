"""What a run writes about itself: metrics.jsonl, TensorBoard (and W&B / MLflow when configured:
one fan-out, `rl.metrics.sinks`), the HDF5 trajectories and the console's step lines. One
`Recorder` per run, in the driver; every record of a step goes through it."""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass

from rl.config import Config
from rl.console import say
from rl.metrics.sinks import MetricFanOut, Outcome
from rl.metrics.tensorboard import MetricsLogger
from rl.metrics.tracking import tracking_sinks
from rl.metrics.trajectories import TrajectoryWriter


@dataclass(frozen=True, slots=True)
class RestartInfo:
    """How this life of the run began; the launcher knows it (`job.run`), the run logs it."""
    count: int = 0
    """How often the scheduler restarted the job (Slurm's restart count; 0 outside Slurm)."""
    previous_signal: int = 0
    """The signal that stopped the previous life (0: a first start, or none was recorded)."""

    def metrics(self) -> dict[str, float]:
        return {"slurm/restart_count": float(self.count),
                "slurm/requeue_signal": float(self.previous_signal)}


class Recorder:
    def __init__(self, cfg: Config):
        self.cfg, self.run_dir = cfg, cfg.run_dir
        self.jsonl = self.run_dir / "metrics.jsonl"
        self.metrics: MetricFanOut | None = None
        self.trajectories: TrajectoryWriter | None = None

    def open(self, step: int, resumed: bool, restart: RestartInfo) -> None:
        """Start writing at `step` (the checkpoint's): TensorBoard events and trajectories of
        later steps, left by a life that did not checkpoint them, are dropped (W&B and MLflow
        cannot drop points: they keep them, and get those steps again)."""
        tensorboard = MetricsLogger(self.run_dir, enabled=self.cfg.logging.tensorboard,
                                    purge_step=step + 1 if resumed else None)
        self.metrics = MetricFanOut(tensorboard, tracking_sinks(self.cfg))
        self.log(step, restart.metrics())
        if self.cfg.logging.hdf5:
            self.trajectories = TrajectoryWriter(self.run_dir / "trajectories.h5")
            if resumed:
                self.trajectories.truncate(step)

    def rewind_jsonl(self, step: int, complete: tuple[int, dict] | None = None) -> None:
        """metrics.jsonl keeps the rows up to `step` (one rewrite); `complete` = (a step, metrics)
        merged into that step's row: the evaluation a stop skipped, done by the resumed run."""
        if not self.jsonl.exists():
            return
        lines = [line for line in self.jsonl.read_text().splitlines()
                 if line.strip() and json.loads(line)["step"] <= step]
        if complete is not None:
            for i in range(len(lines) - 1, -1, -1):
                row = json.loads(lines[i])
                if row["step"] == complete[0]:
                    lines[i] = json.dumps({**row, **complete[1]})
                    break
        self.jsonl.write_text("".join(line + "\n" for line in lines))

    def log(self, step: int, metrics: dict) -> None:
        """TensorBoard and the trackers (metrics.jsonl holds one row per step: `record`)."""
        self.metrics.log(step, metrics)  # type: ignore[union-attr]  # lint baseline (issue 39)

    def histogram(self, step: int, tag: str, values) -> None:
        self.metrics.histogram(step, tag, values)  # type: ignore[union-attr]  # lint baseline (issue 39)

    def record(self, step: int, metrics: dict, batch=None, parts=None, advantages=None,
               old_logprobs: list[list[float]] | None = None, lags=None) -> None:
        """A finished step: TensorBoard, its metrics.jsonl row, its trajectories (`batch`, a
        `rl.pipeline.RolloutBatch`, with its rewards and advantages; `old_logprobs`: the
        trainer's, in batch order, `TrainStats.old_logprobs_in_order`), its console line."""
        self.log(step, metrics)
        with open(self.jsonl, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.trajectories is not None and batch is not None:
            samples = batch.samples()
            self.trajectories.append(
                step=step, weight_version=[s.weight_version for s in samples],
                prompt_index=[i for i, g in zip(batch.indices, batch.groups) for _ in g],
                prompt_ids=[s.prompt_ids for s in samples],
                response_ids=[s.response_ids for s in samples],
                rollout_logprobs=[s.logprobs for s in samples], reward=parts.total,
                advantage=advantages, finish_reason=[s.finish_reason for s in samples],
                old_logprobs=old_logprobs, version_spans=[s.spans() for s in samples],
                staleness=lags,
                routing=[s.routing for s in samples] if self.cfg.logging.save_routing
                and all(s.routing is not None for s in samples) else None,
                **_episode_columns(samples))
        last = step == self.cfg.num_steps
        if step % self.cfg.logging.print_every == 0 or last or "eval/pass1" in metrics:
            say(format_step(self.cfg, step, metrics))

    def close(self, outcome: Outcome = "done") -> None:
        """`outcome`: how this life ended (`rl.metrics.sinks.Outcome`), for the trackers."""
        if self.metrics is not None:
            self.metrics.close(outcome)


def _episode_columns(samples) -> dict:
    """The trajectory file's multi-turn columns of `samples` (none for single-turn ones)."""
    if all(s.turns is None for s in samples):
        return {}
    return {"loss_mask": [s.loss_mask or [] for s in samples],
            "episodes": [None if s.turns is None else {"turns": s.turns, "error": s.env_error}
                         for s in samples]}


def rollout_metrics(samples, parts, seconds: float, n_samples: int, failures: int,
                    tokens: int | None = None) -> dict:
    """A step's reward/ and rollout/ metrics from its samples (`rl.rollout.base.Sample`) and
    their `RewardBreakdown`; `seconds`: generation wall time; `failures`: reward failures so far;
    `tokens`: the tokens generated in `seconds` (default: the samples' response tokens)."""
    total = parts.total
    lengths = [len(s.response_ids) for s in samples]
    tokens = sum(lengths) if tokens is None else tokens
    groups = [total[i:i + n_samples] for i in range(0, len(total), n_samples)]
    return {"reward/zero_std_frac": sum(max(g) == min(g) for g in groups) / len(groups),
            "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples)
            / len(samples),
            "reward/mean": statistics.fmean(total),
            "reward/std": statistics.pstdev(total) if len(total) > 1 else 0.0,
            "reward/failures": float(failures),
            "reward/format": statistics.fmean(parts.format),
            "reward/unclosed_thinking_frac": sum(parts.unclosed) / len(samples),
            "rollout/accuracy": sum(c >= 1.0 for c in parts.correctness) / len(samples),
            "rollout/response_length": statistics.fmean(lengths),
            "rollout/tokens_per_s": tokens / max(seconds, 1e-9)}


def format_step(cfg: Config, step: int, m: dict) -> str:
    """The console line of one step, from its metrics (METRIC_TAGS names).

    `acc` (the verifier's) is shown only where it can differ from `reward`: a built-in 0/1
    verifier alone makes them the same number. `format` (the format reward before its weight)
    only when `reward.format_weight` > 0; `trunc` is the fraction cut at max_new_tokens.
    """
    r = cfg.reward
    parts = [f"step {step:>4}/{cfg.num_steps}", f"reward {m.get('reward/mean', 0):.3f}"]
    if r.format_weight > 0 or r.function not in ("math", "exact"):
        parts.append(f"acc {m.get('rollout/accuracy', 0):.3f}")
    if r.format_weight > 0:
        parts.append(f"format {m.get('reward/format', 0):.3f}")
    parts += [f"len {m.get('rollout/response_length', 0):.1f}",
              f"trunc {m.get('rollout/truncated_frac', 0):.2f}",
              f"{m.get('rollout/tokens_per_s', 0):.0f} tok/s",
              f"loss {m.get('train/loss', 0):+.4f}", f"kl {m.get('train/approx_kl', 0):.4f}",
              f"gnorm {m.get('train/grad_norm', 0):.3f}", f"sync {m.get('sync/seconds', 0):.2f}s"]
    if cfg.algorithm.max_staleness:
        parts.append(f"stale {m.get('rollout/staleness_mean', 0):.2f} idle trainer "
                     f"{m.get('trainer/idle_ratio', 0):.2f} rollout "
                     f"{m.get('rollout/idle_ratio', 0):.2f}")
    if cfg.algorithm.dynamic_sampling:
        parts.append(f"rounds {m.get('sampling/gen_rounds', 0):.0f} dropped "
                     f"{m.get('sampling/dropped_groups', 0):.0f} padded "
                     f"{m.get('sampling/padded_groups', 0):.0f}")
    if "eval/pass1" in m:
        parts.append(f"EVAL pass@1 {m['eval/pass1']:.3f}")
    parts.append(f"{m.get('time/step', 0):.1f}s")
    return " | ".join(parts)

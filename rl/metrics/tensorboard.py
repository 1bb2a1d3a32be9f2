"""Scalar metrics to TensorBoard, with one documented table of every tag the loop writes.

Event files go to `run_dir/tensorboard` (one TensorBoard "run" per training run). Resuming at
step s opens the writer with `purge_step=s`: the new event file starts with a SessionLog.START at
step s, and TensorBoard's readers then drop every older event with step >= s, so curves continue
without gaps or duplicates although the old events stay on disk. A fresh run writes a START marker
at step 0 as well: TensorBoard's Python loader (`--load_fast=false`) takes a run's first START for
the beginning of the run and purges only on later ones; its default Rust loader purges on every
START. tests/rl/test_metrics.py checks both loaders through a real `tensorboard` server.

Read the curves with `tensorboard --logdir RUN_DIR/tensorboard`.
"""
from __future__ import annotations

import logging
import math
import re
import time
from pathlib import Path
from typing import Any, Mapping

log = logging.getLogger(__name__)

TENSORBOARD_SUBDIR = "tensorboard"

# tag -> description (units in brackets). Every tag the loop writes is listed here; the table in
# docs/monitoring.md is `markdown_table()`'s output (tests/rl/test_metrics.py compares them).
METRIC_TAGS: dict[str, str] = {
    "reward/mean": "Mean reward over all samples of the step's rollout batch.",
    "reward/std": "Std of the rewards over the step's rollout batch.",
    "reward/failures": "Samples whose reward function raised, exited, crashed its worker, returned "
                       "a non-number or timed out, scored 0 (cumulative count).",
    "reward/zero_std_frac": "Fraction of the trained prompt groups with identical rewards (zero "
                            "advantage); with algorithm.dynamic_sampling only padded ones.",
    "reward/format": "Mean format reward of the step's rollout batch, before reward.format_weight "
                     "(1 = the answer in the expected form).",
    "reward/unclosed_thinking_frac": (
        "Fraction of the step's responses without reward.answer_after's marker (DeepSeek-V4 "
        "thinking: reasoning never closed with `</think>`), scored 0; 0 when it is null."),
    "reward/overlong_penalty": "Mean overlong penalty in the step's rewards (algorithm."
                               "overlong_buffer; 0 when off) [reward, <= 0].",
    "rollout/accuracy": "Fraction of samples judged correct by the verifier.",
    "rollout/response_length": "Mean response length [tokens].",
    "rollout/truncated_frac": "Fraction of responses cut at max_new_tokens (finish reason 'length').",
    "rollout/tokens_per_s": "Generated tokens per second of rollout wall time, all engines.",
    "rollout/staleness_mean": "Mean staleness of the trained samples: weight versions between the "
                              "oldest weights that sampled a sample and the policy trained on it "
                              "(0 on-policy, <= algorithm.max_staleness).",
    "rollout/staleness_max": "Max staleness of the step's trained samples.",
    "rollout/dropped_samples": "Samples dropped for exceeding algorithm.max_staleness "
                               "(cumulative count).",
    "rollout/resumed_frac": "Fraction of samples interrupted by a weight update and resumed with "
                            "the new weights (algorithm.partial_rollouts: resume).",
    "rollout/idle_ratio": "Fraction of the step's wall time the rollout engines did not work "
                          "(generate, score, receive weights); mean over engines.",
    "sampling/gen_rounds": "Generation rounds behind the step's batch (algorithm.dynamic_sampling "
                           "refills; 1 without it).",
    "sampling/kept_groups": "Trained prompt groups whose rewards differ (non-zero advantage).",
    "sampling/dropped_groups": "Prompt groups generated for the step and not trained on: all "
                               "rewards equal (algorithm.dynamic_sampling; 0 without it).",
    "sampling/padded_groups": "Groups with all rewards equal trained on because "
                              "algorithm.max_gen_rounds left the batch short (0 without dynamic "
                              "sampling).",
    "sampling/generated_tokens": "Response tokens generated for the step's batch, every round "
                                 "and dropped group included [tokens].",
    "sampling/generated_tokens_total": "sampling/generated_tokens summed over the run so far "
                                       "(plot eval/pass1 against it) [tokens].",
    "sampling/reward_mean": "Mean reward over every sample generated for the step, dropped groups "
                            "included (reward/mean is the trained batch's).",
    "trainer/idle_ratio": "Fraction of the step's wall time the trainer group did not work (train, "
                          "send weights).",
    "train/loss": "Total policy loss (pg + kl_coef*kl - entropy_coef*entropy), mini-batch mean.",
    "train/pg_loss": "Clipped policy-gradient (surrogate) loss, TIS-weighted.",
    "train/kl": "KL(policy || reference) by algorithm.kl_estimator, aggregated like the loss.",
    "train/entropy": "Mean per-token policy entropy [nats].",
    "train/approx_kl": "KL(old || new) by the k3 estimator: how far the optimizer moved the policy.",
    "train/ratio_mean": "Mean PPO ratio exp(logp - old_logp) over valid tokens.",
    "train/clip_frac_low": "Fraction of tokens with A < 0 clipped at 1 - clip_low (no gradient).",
    "train/clip_frac_high": "Fraction of tokens with A > 0 clipped at 1 + clip_high (no gradient).",
    "train/tis_ratio_mean": "Mean of exp(old_logp_trainer - logp_rollout) before the TIS cap.",
    "train/tis_ratio_max": "Max TIS ratio before the cap (rollout/trainer mismatch outliers).",
    "train/tis_ratio_min": "Min TIS ratio.",
    "train/tis_capped_frac": "Fraction of tokens whose TIS ratio exceeded algorithm.tis_cap.",
    "rollout/routing_agreement": (
        "With algorithm.routing_replay r3: fraction of the engine's (token, layer, expert) "
        "choices that the trainer's own routers also make (old-policy pass, before replay)."),
    "train/routing_agreement": (
        "With algorithm.routing_replay r2: fraction of the old-policy pass's expert choices "
        "that the update passes' own routers also make."),
    "train/rollout_logp_absdiff": (
        "With r3: mean abs(logp_trainer_old - logp_rollout) over response tokens, replaying "
        "the engine's routing."),
    "train/noreplay_rollout_logp_absdiff": (
        "With r3: the same without replay (one extra forward per micro-batch)."),
    "train/noreplay_tis_ratio_mean": (
        "With r3 and TIS: train/tis_ratio_mean as it would be without replay."),
    "train/noreplay_tis_capped_frac": (
        "With r3 and TIS: train/tis_capped_frac as it would be without replay."),
    "train/grad_norm": "Gradient L2 norm before clipping (mean over the step's applied optimizer steps).",
    "train/skipped": "Optimizer steps of this step skipped on every rank for a non-finite loss or "
                     "gradient (no update, LR schedule not advanced).",
    "train/lr": "Learning rate at the step's last optimizer step.",
    "train/tokens_per_s": "Trained tokens (prompt + response, unpadded) per second of train time.",
    "sync/seconds": "Wall time of the trainer -> rollout weight update [s].",
    "sync/gbytes_per_s": "Weight-update throughput: sync/bytes / sync/seconds / 1e9 [GB/s].",
    "sync/bytes": "Bytes sent on the wire for one weight update (after FP8 quantisation if on).",
    "sync/logprob_max_diff": "With sync.check_logprobs: max abs(trainer - engine) log-prob of a fixed "
                             "probe sequence right after the update.",
    "time/step": "Wall time of the whole step [s].",
    "time/rollout": "Wall time the driver waited for generation (rollouts overlapped with training "
                    "by max_staleness >= 1 count only where they outlast it) [s].",
    "time/reward": "Wall time of reward computation [s].",
    "time/train": "Wall time of log-probs + optimizer steps [s].",
    "time/sync": ("Wall time of the weight update: gather, bucket, send, load in every engine, "
                  "version check (and the log-prob probe with sync.check_logprobs) [s]. Engines "
                  "serve one call at a time, so none generates while its weights load."),
    "time/eval": "Wall time of evaluation, on steps that evaluate [s].",
    "eval/pass1": "Greedy accuracy on the eval set (pass@1).",
    "eval/mean_reward": "Mean reward of the greedy eval samples.",
    "eval/pass_k": "pass@k on the eval set at eval.pass_k_temperature, k = eval.pass_k.",
    "eval/env_failures": "Multi-turn (env.path): greedy eval episodes whose environment failed.",
    "eval/turns_mean": "Multi-turn: model turns per greedy eval episode.",
    "eval/tool_calls_mean": "Multi-turn: tool calls per greedy eval episode.",
    "eval/tool_call_rate": "Multi-turn: fraction of greedy eval episodes with at least one tool "
                           "call.",
    "eval/env_tokens_mean": "Multi-turn: environment (tool-result) tokens per greedy eval "
                            "episode.",
    "eval/cut_frac": "Multi-turn: fraction of greedy eval episodes cut (finish reason 'length'): "
                     "a turn at rollout.max_new_tokens, or the episode at env.max_turns or "
                     "env.max_response_tokens.",
    "env/failures": "Multi-turn: training episodes whose environment raised, hung past "
                    "env.step_timeout_s, crashed its worker or returned garbage; each scored 0 "
                    "(cumulative count).",
    "env/turns_mean": "Multi-turn: model turns per episode of the step.",
    "env/tool_calls_mean": "Multi-turn: tool calls per episode of the step.",
    "env/tool_call_rate": "Multi-turn: fraction of the step's episodes with at least one tool "
                          "call.",
    "env/env_tokens_mean": "Multi-turn: environment (tool-result) tokens per episode: context, "
                           "masked out of the loss.",
    "env/cut_frac": "Multi-turn: fraction of the step's episodes cut (finish reason 'length'): "
                    "their last turn at rollout.max_new_tokens, or the episode at env.max_turns "
                    "or env.max_response_tokens (reward 0).",
    "faults/rollout_restarts": "Rollout engines restarted after a failure (cumulative count).",
    "faults/skipped_steps": "Steps skipped for a non-finite loss or gradient (cumulative count).",
    "weights/version": "Weight version served by the rollout engines after this step's sync.",
    "slurm/restart_count": "SLURM_RESTART_COUNT at each (re)start of the run, logged at the step "
                           "it starts from (0 outside Slurm) [count].",
    "slurm/requeue_signal": "Number of the signal that stopped the run's previous life, logged at "
                            "each start (10 USR1, 12 USR2 = time limit or preemption, 15 TERM; "
                            "0 = first start or no signal recorded).",
}

# The tags written only with one algorithm.routing_replay mode (tag -> mode); every other tag of
# METRIC_TAGS is written by every run (its description says under which settings it is non-zero).
REPLAY_TAGS: dict[str, str] = {
    "rollout/routing_agreement": "r3", "train/rollout_logp_absdiff": "r3",
    "train/noreplay_rollout_logp_absdiff": "r3", "train/noreplay_tis_ratio_mean": "r3",
    "train/noreplay_tis_capped_frac": "r3", "train/routing_agreement": "r2"}

# The tags written only by multi-turn runs (env.path set).
ENV_TAGS: frozenset[str] = frozenset(t for t in METRIC_TAGS if t.startswith("env/")) | {
    "eval/env_failures", "eval/turns_mean", "eval/tool_calls_mean", "eval/tool_call_rate",
    "eval/env_tokens_mean", "eval/cut_frac"}

# Histograms (TensorBoard's HISTOGRAMS tab), tag -> description.
HISTOGRAM_TAGS: dict[str, str] = {
    "rollout/staleness": "Staleness of every trained sample of the step [weight versions].",
}

_TAG_RE = re.compile(r"^[a-z0-9_]+/[a-z0-9_]+$")


def markdown_table() -> str:
    """docs/monitoring.md's table of METRIC_TAGS: a header and one `| tag | meaning |` row per
    tag."""
    lines = ["| tag | meaning |", "| --- | --- |"]
    lines += [f"| `{tag}` | {desc} |" for tag, desc in METRIC_TAGS.items()]
    return "\n".join(lines) + "\n"


def _to_float(tag: str, value: Any) -> float:
    try:
        return float(value)  # accepts Python numbers, numpy scalars and 0-dim/1-element tensors
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a multi-element tensor
        raise ValueError(f"metric {tag!r}: got {value!r}, expected a number") from None


class MetricsLogger:
    """Writes scalars to `run_dir/tensorboard`.

    Args:
      run_dir: the run directory; the event files go to `run_dir/tensorboard`.
      enabled: when False every call is a no-op (logging.tensorboard: false, or non-zero ranks).
        Call `flush()` once per step: the writer otherwise buffers up to 30 s of events.
      purge_step: on resume, the step the run continues from; events with step >= purge_step
        written before are hidden by TensorBoard's readers.
      strict: raise on tags missing from METRIC_TAGS instead of warning once per tag (tests use it
        to keep the table complete).
    """

    def __init__(self, run_dir: str | Path, enabled: bool = True, purge_step: int | None = None,
                 strict: bool = False):
        self.log_dir = Path(run_dir) / TENSORBOARD_SUBDIR
        self.enabled = enabled
        self.strict = strict
        self._warned: set[str] = set()
        self._writer = None
        if not enabled:
            return
        if purge_step is not None and purge_step < 0:
            raise ValueError(f"purge_step: got {purge_step!r}, expected a step >= 0")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        has_events = any(self.log_dir.glob("events.out.tfevents.*"))
        if purge_step is None and not has_events:
            # A fresh run starts with its own START marker too: TensorBoard's Python loader
            # (--load_fast=false) treats the first START of a run as the beginning, not a restart,
            # and would otherwise ignore the purge of the first resume.
            purge_step = 0
        elif purge_step is None:
            log.warning("%s already holds event files and no purge_step was given: steps "
                        "written again will appear twice in TensorBoard", self.log_dir)
        if purge_step is not None and has_events:
            _wait_for_newer_second(self.log_dir)
        # Imported here so that readers of this module (launch.inspect) do not pay for torch.
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step,
                                     flush_secs=30)

    def numbers(self, metrics: Mapping[str, Any]) -> dict[str, float]:
        """`metrics` as floats, every tag checked against METRIC_TAGS (ValueError on a bad tag or
        a value that is not a number), whether or not TensorBoard is enabled: what
        `rl.metrics.sinks.MetricFanOut` hands every sink."""
        out = {}
        for tag, value in metrics.items():
            self._check_tag(tag)
            out[tag] = _to_float(tag, value)
        return out

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Write `metrics` (tag -> number) at `step`. Non-finite values are written as they are
        (a NaN on the curve is the signal) but logged as a warning."""
        if self._writer is None:
            return
        for tag, number in self.numbers(metrics).items():
            if not math.isfinite(number):
                log.warning("metric %s is %s at step %d", tag, number, step)
            self._writer.add_scalar(tag, number, global_step=step)

    def histogram(self, step: int, tag: str, values) -> None:
        """Write a histogram of `values` (a documented HISTOGRAM_TAGS tag) at `step`."""
        if tag not in HISTOGRAM_TAGS:
            raise ValueError(f"histogram tag {tag!r} is not documented in HISTOGRAM_TAGS "
                             f"(expected one of: {', '.join(HISTOGRAM_TAGS)})")
        if self._writer is None or len(values) == 0:
            return
        import numpy as np
        self._writer.add_histogram(tag, np.asarray(values, dtype=np.float64), global_step=step)

    def _check_tag(self, tag: str) -> None:
        if tag in METRIC_TAGS:
            return
        if self.strict or not _TAG_RE.match(tag):
            raise ValueError(f"metric tag {tag!r} is not documented in rl.metrics.METRIC_TAGS "
                             f"(expected one of: {', '.join(METRIC_TAGS)})")
        if tag not in self._warned:
            self._warned.add(tag)
            log.warning("metric tag %r is not in rl.metrics.METRIC_TAGS; add it to the table", tag)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _wait_for_newer_second(log_dir: Path) -> None:
    """Make the next event file sort after the existing ones.

    TensorBoard reads a run's event files in file-name order, and the purge only hides events read
    *before* the START marker. File names start with the creation time in whole seconds, so a
    file created in the same second as an existing one could sort before it (the suffix is a
    per-process counter). A real resume is a new process seconds later and never waits; tests that
    reopen at once wait < 1 s.
    """
    newest = 0
    for path in log_dir.glob("events.out.tfevents.*"):
        parts = path.name.split(".")
        if len(parts) > 3 and parts[3].isdigit():
            newest = max(newest, int(parts[3]))
    while int(time.time()) <= newest:
        time.sleep(0.05)

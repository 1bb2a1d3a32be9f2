"""The RL driver loop: rollout -> reward -> advantage -> train -> sync -> evaluate -> checkpoint.

With `algorithm.max_staleness >= 1` the rollout of the next steps overlaps the training of this
one (`rl.pipeline`); the steps read the same either way.

Heavy lifting lives in the components; this file should read like the paragraph that describes
it. `run(cfg)` returns a `RunResult`; a stop signal ends it with status "stopped" after a
checkpoint (the caller exits with EXIT_REQUEUE).
"""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field

import torch

from rl.config import Config
from rl.evaluate import mean_of_last_evals, read_metrics_jsonl
from rl.pipeline import RolloutPipeline, stale_groups, staleness
from rl.rollout.base import SamplingParams
from rl.run_state import RunContext, open_run
from rl.signals import StepAbandoned, StopRequest
from rl.trainer.losses import grpo_advantages

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RunResult:
    status: str
    """`done`, `stopped` (signal; checkpointed) or `aborted` (non-finite steps; checkpointed)."""
    step: int
    run_dir: str
    warm_start_accuracy: float | None = None
    final_accuracy: float | None = None
    final_mean_accuracy: float | None = None
    """Mean held-out pass@1 of the last FINAL_EVALS evaluations, over all lives of the run."""
    final_mean_steps: list[int] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)


def run(cfg: Config, *, resume: bool = True, force: bool = False,
        stop: StopRequest | None = None) -> RunResult:
    stop = stop or StopRequest()
    ctx = open_run(cfg, resume=resume, force=force)
    try:
        return _loop(ctx, stop)
    finally:
        ctx.close()


def _loop(ctx: RunContext, stop: StopRequest) -> RunResult:
    cfg, rt, state = ctx.cfg, ctx.runtime, ctx.state
    result = RunResult(status="done", step=state.step, run_dir=str(ctx.run_dir),
                       warm_start_accuracy=state.warm_start_accuracy)
    if state.step == 0 and cfg.eval.at_start and state.warm_start_accuracy is None:
        metrics = ctx.evaluate(step=0)
        state.warm_start_accuracy = result.warm_start_accuracy = metrics.get("eval/pass1")
        ctx.log(0, metrics)
    sampling = SamplingParams(n=cfg.rollout.n_samples, temperature=cfg.rollout.temperature,
                              top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                              max_new_tokens=cfg.rollout.max_new_tokens, seed=0,
                              return_routing=cfg.algorithm.routing_replay == "r3")
    pipe = RolloutPipeline(ctx, sampling, ctx.pending, stop)
    bound = cfg.algorithm.max_staleness
    busy_before = ctx.engine_busy_seconds()
    while state.step < cfg.num_steps and not stop.requested:
        step = state.step + 1
        t_step = time.perf_counter()
        before = (ctx.sampler.state_dict(), ctx.rewards.failures, state.dropped_samples)
        try:  # until training starts, a stop abandons the step: nothing persistent changed yet
            # 1. the step's rollout batch: generated ahead (max_staleness >= 1) or now; a dead
            #    engine is restarted, re-synced, and the generation retried
            t0 = time.perf_counter()
            batch = pipe.take(step)
            t_rollout = time.perf_counter() - t0
            # 2. samples older than max_staleness are dropped (e.g. after lowering it on resume)
            stale = stale_groups(batch.groups, state.weight_version, bound)
            if any(stale) and cfg.algorithm.stale_samples == "drop":
                state.dropped_samples += sum(len(g) for g, old in zip(batch.groups, stale) if old)
                log.warning("step %d: dropping %d of %d prompt groups older than max_staleness %d",
                            step, sum(stale), len(stale), bound)
                keep = [i for i, old in enumerate(stale) if not old]
                batch.groups = [batch.groups[i] for i in keep]
                batch.indices = [batch.indices[i] for i in keep]
                if not keep:  # nothing left to train on: sample the step again, on-policy
                    batch = pipe.generate_now(step)
            # 3. the next steps' batches start generating with the current weights
            pipe.launch_ahead(step, cfg.num_steps)
            # 4. rewards and advantages
            t0 = time.perf_counter()
            samples = batch.samples()
            lags = staleness(samples, state.weight_version)
            examples = [ctx.train[i] for i, g in zip(batch.indices, batch.groups) for _ in g]
            parts = ctx.rewards.score([s.text for s in samples], examples,
                                      cancelled=lambda: stop.requested)
            rewards_G = torch.tensor(parts.total, dtype=torch.float32).view(len(batch.groups), -1)
            adv = grpo_advantages(rewards_G, cfg.algorithm.normalize_std).view(-1).tolist()
            t_reward = time.perf_counter() - t0
            if stop.requested:
                raise StepAbandoned("stop requested before training")
        except StepAbandoned as e:
            log.warning("step %d abandoned (%s); checkpointing step %d", step, e, state.step)
            pipe.abandon()
            ctx.sampler.load_state_dict(before[0])
            ctx.rewards.failures, state.dropped_samples = before[1], before[2]
            break
        # 5. train, while the engines generate ahead (a step that has started is finished, then
        #    checkpointed: the trainer ranks cannot be interrupted)
        t0 = time.perf_counter()
        train_batch = {"prompt_ids": [s.prompt_ids for s in samples],
                       "response_ids": [s.response_ids for s in samples],
                       "rollout_logprobs": [s.logprobs for s in samples], "advantages": adv}
        if sampling.return_routing:
            train_batch["routing"] = [s.routing for s in samples]
        train_stats, old_logprobs = rt.train(train_batch, step)
        t_train = time.perf_counter() - t0
        # the ranks skipped (together) any optimizer step with a non-finite loss or gradient
        bad = train_stats["train/skipped"] > 0
        state.bad_in_a_row = state.bad_in_a_row + 1 if bad else 0
        state.skipped_steps += int(bad)
        # 6. the generations in flight end (finished, or cut at the interrupt budget) before
        #    the online weight update trainer -> rollout. After a stop they are awaited only as
        #    long as checkpoint.grace_period_s allows, and the update is left to the resumed run
        #    (which syncs the engines at its start)
        t0 = time.perf_counter()
        pipe.collect()
        t_rollout += time.perf_counter() - t0
        t0 = time.perf_counter()
        if stop.requested:
            state.weight_version, sync_stats = state.weight_version + 1, {}
        else:
            sync_stats = ctx.sync(state.weight_version + 1)
        t_sync = time.perf_counter() - t0
        # 7. periodic evaluation (after a stop the checkpoint goes first: the resumed run
        #    evaluates this step's weights at its start and completes this step's record)
        t0 = time.perf_counter()
        metrics = {}
        due = cfg.eval.every and step % cfg.eval.every == 0 or step == cfg.num_steps
        if due and not stop.requested:
            metrics.update(ctx.evaluate(step))
        elif due:
            state.eval_pending = step
        t_eval = time.perf_counter() - t0
        # 8. log, trajectories, checkpoint
        state.step = step
        t_total = time.perf_counter() - t_step
        busy = ctx.engine_busy_seconds()
        metrics.update(train_stats)
        metrics.update(ctx.rollout_metrics(samples, parts, batch.seconds))
        metrics.update({"sync/seconds": sync_stats.get("seconds", 0.0),
                        "sync/gbytes_per_s": sync_stats.get("gbytes_per_s", 0.0),
                        "sync/bytes": float(sync_stats.get("bytes", 0)),
                        **({"sync/logprob_max_diff": sync_stats["logprob_max_diff"]}
                           if "logprob_max_diff" in sync_stats else {}),
                        "weights/version": float(state.weight_version),
                        "rollout/staleness_mean": statistics.fmean(lags) if lags else 0.0,
                        "rollout/staleness_max": float(max(lags, default=0)),
                        "rollout/dropped_samples": float(state.dropped_samples),
                        "rollout/resumed_frac": sum(len(s.version_spans) > 1 for s in samples)
                        / max(len(samples), 1),
                        # (an engine restarted this step starts its busy count at 0: clamp)
                        "rollout/idle_ratio": min(1.0, max(0.0, 1.0 - (busy - busy_before)
                                                           / t_total)),
                        "trainer/idle_ratio": max(0.0, 1.0 - (t_train + t_sync) / t_total),
                        "faults/rollout_restarts": float(rt.restarts + state.restarts_before),
                        "faults/skipped_steps": float(state.skipped_steps),
                        "time/rollout": t_rollout, "time/reward": t_reward, "time/train": t_train,
                        "time/sync": t_sync, "time/eval": t_eval, "time/step": t_total})
        busy_before = busy
        ctx.metrics.histogram(step, "rollout/staleness", lags)
        ctx.record(step, metrics, batch.indices, batch.groups, parts, adv, old_logprobs, lags)
        result.history.append({"step": step, **metrics})
        if state.bad_in_a_row >= cfg.checkpoint.max_bad_steps:
            log.error("%d non-finite steps in a row: aborting with a checkpoint", state.bad_in_a_row)
            ctx.save_checkpoint(pipe.state_dict())
            result.status = "aborted"
            break
        if stop.requested or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
            ctx.save_checkpoint(pipe.state_dict())
    if stop.requested and result.status == "done":
        if ctx.last_saved_step != state.step:
            ctx.save_checkpoint(pipe.state_dict())
        result.status = "stopped"
    elif result.status == "done" and ctx.last_saved_step != state.step:
        ctx.save_checkpoint(pipe.state_dict())
    result.step = state.step
    result.warm_start_accuracy = state.warm_start_accuracy
    result.final_accuracy = state.last_eval.get("eval/pass1")
    result.final_mean_accuracy, result.final_mean_steps = mean_of_last_evals(
        read_metrics_jsonl(ctx.run_dir / "metrics.jsonl"))
    return result

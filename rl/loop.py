"""The RL driver loop: rollout -> reward -> advantage -> train -> sync -> evaluate -> checkpoint.

With `algorithm.max_staleness >= 1` the rollout of the next steps overlaps the training of this
one (`rl.pipeline`); the steps read the same either way.

`Run` lists the run's parts, each owning its state (torchtitan's Trainer is the model); `step`
is one RL step and the one place where a step is composed. Heavy lifting lives in the parts.
`run(cfg)` returns a `RunResult`; a stop signal ends it with status "stopped" after a checkpoint
(the caller exits with EXIT_REQUEUE).
"""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal

from rl import private_files
from rl.checkpoint import Checkpointer
from rl.config import Config
from rl.console import say
from rl.data.source import PromptSource
from rl.envs.generator import MultiTurnGenerator, start_pool
from rl.envs.scoring import EnvScorer, episode_metrics
from rl.evaluate import Evaluator, mean_of_last_evals, read_metrics_jsonl
from rl.faults import FaultInjector
from rl.pipeline import RolloutPipeline
from rl.publisher import Generator, WeightPublisher
from rl.recorder import Recorder, RestartInfo, rollout_metrics
from rl.resume import check_and_save_config, resume_hash, resume_hashes
from rl.rewards.computer import RewardComputer, protected_paths
from rl.rollout.base import SamplingParams
from rl.runtime import Runtime
from rl.scoring import BatchScorer, ScoredBatch
from rl.signals import StepAbandoned, StopRequest
from rl.trainer.batch import TrainBatch, TrainStats

log = logging.getLogger(__name__)

RunStatus = Literal["done", "stopped", "aborted"]
"""How a run ended: `done`, `stopped` (signal; checkpointed) or `aborted` (non-finite steps;
checkpointed). The launcher's outcome dict (`job.run.exit_status`) adds its own statuses."""
StepOutcome = Literal["trained", "abandoned", "aborted"]
"""How one step ended: `trained`, `abandoned` (a stop before training: nothing changed) or
`aborted` (too many non-finite steps in a row; checkpointed)."""


@dataclass(slots=True)
class RunResult:
    status: RunStatus
    """`done`, `stopped` (signal; checkpointed) or `aborted` (non-finite steps; checkpointed)."""
    step: int
    run_dir: str
    warm_start_accuracy: float | None = None
    final_accuracy: float | None = None
    final_mean_accuracy: float | None = None
    """Mean held-out pass@1 of the last FINAL_EVALS evaluations, over all lives of the run."""
    final_mean_steps: list[int] = field(default_factory=list)
    eval_problems: int | None = None
    """Held-out problems each evaluation scores: the eval set, capped at eval.num_prompts."""
    history: list[dict] = field(default_factory=list)


@dataclass(slots=True)
class TrainState:
    """The loop's own counters (checkpointed with the other parts' state)."""
    step: int = 0
    warm_start_accuracy: float | None = None
    skipped_steps: int = 0
    bad_in_a_row: int = 0
    dropped_samples: int = 0
    """Samples dropped for being older than algorithm.max_staleness (cumulative)."""
    generated_tokens: int = 0
    """Response tokens generated for the trained steps, every dynamic-sampling round (cumulative;
    counted from the resume for a checkpoint written before it existed)."""

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for f in fields(self):
            if f.name in state or f.name not in _ADDED_LATER:
                setattr(self, f.name, state[f.name])


_ADDED_LATER = ("generated_tokens",)
"""TrainState fields that older checkpoints lack (they keep their default)."""


@dataclass(slots=True)
class PhaseSeconds:
    """Wall seconds of one step's phases: its `time/*` metrics."""
    rollout: float = 0.0
    """Taking the step's batch, plus the wait for the generations in flight after training."""
    reward: float = 0.0
    train: float = 0.0
    sync: float = 0.0
    eval: float = 0.0
    step: float = 0.0

    def metrics(self) -> dict[str, float]:
        return {f"time/{f.name}": getattr(self, f.name) for f in fields(self)}


def setup_logging(run_dir: Path) -> None:
    root = logging.getLogger()
    if not any(isinstance(h, logging.FileHandler) and h.baseFilename == str(run_dir / "driver.log")
               for h in root.handlers):
        fh = logging.FileHandler(run_dir / "driver.log")
        fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(fh)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)


def run(cfg: Config, *, resume: bool = True, force: bool = False,
        stop: StopRequest | None = None, restart: RestartInfo = RestartInfo()) -> RunResult:
    """`restart`: how this life began (the launcher reads the scheduler's environment)."""
    from rl.cluster.placement import choose_placement, sync_backend
    from rl.metrics.tracking import check_packages
    from rl.sft import warm_start_dir
    sync_backend(cfg, choose_placement(cfg))  # ConfigError now, not after the warm start
    check_packages(cfg.logging)  # W&B / MLflow importable here (the job's nodes) too
    private_files.run_dir(cfg.run_dir)  # 0700; ConfigError when another user owns it
    setup_logging(cfg.run_dir)
    check_and_save_config(cfg, resume, force)
    model_dir = warm_start_dir(cfg)  # the SFT warm start (cached), when model.warm_start
    r = Run(cfg, model_dir, stop or StopRequest())  # starts the worker groups
    failed = True
    try:
        r.start(resume, force, restart)
        result = r.train()
        failed = False
    finally:
        r.close(failed, status=None if failed else result.status)
    if result.status == "done" and cfg.checkpoint.export_final:
        from rl.export import export_final  # after close: the workers' memory is free again
        try:
            export_final(cfg.run_dir, model_dir, say)
        except Exception as e:  # noqa: BLE001 - the run is done and checkpointed: no restart
            log.error("checkpoint.export_final failed", exc_info=True)
            say(f"export failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''});"
                f" the checkpoint is intact: python -m launch.export {cfg.run_dir} --format hf "
                "--out DIR")
    return result


class Run:
    """One run: its parts, each owning its state, and the loop over its steps (`train`)."""
    cfg: Config
    state: TrainState
    source: PromptSource
    """Train/eval prompts, encoded, and the seeded sampler."""
    rewards: RewardComputer
    episodes: MultiTurnGenerator | None
    """Multi-turn episodes against `env.path`'s environment (None: single-turn rollouts)."""
    env_scorer: EnvScorer
    """The episodes' rewards and the count of failed ones."""
    runtime: Runtime
    """The trainer ranks and rollout engines."""
    publisher: WeightPublisher
    """Weight version, engine recovery, the log-prob probe."""
    pipeline: RolloutPipeline
    """Each step's rollout batch (generated ahead with max_staleness >= 1)."""
    scorer: BatchScorer
    """Rewards, dynamic sampling's refill rounds, advantages."""
    evaluator: Evaluator
    recorder: Recorder
    """metrics.jsonl, TensorBoard, trajectories, console."""
    checkpointer: Checkpointer
    faults: FaultInjector
    """Fault injection for the recovery tests (`rl.faults`): inert unless its variables are set."""
    restart: RestartInfo
    """How this life of the run began (set by `start`)."""

    def __init__(self, cfg: Config, model_dir: Path, stop: StopRequest):
        self.cfg, self.stop = cfg, stop
        self.state = TrainState()
        self.source = PromptSource.from_model_dir(cfg, model_dir)
        self.rewards = RewardComputer(cfg.reward, protect=protected_paths(cfg))  # its workers
        env_pool = start_pool(cfg)  # the environment's workers (ConfigError: cannot import it)
        self.env_scorer = EnvScorer()
        self.recorder = Recorder(cfg)
        opt_steps = cfg.num_steps * cfg.trainer.ppo_epochs * cfg.trainer.num_mini_batches
        self.runtime = Runtime(cfg, str(model_dir), total_optimizer_steps=opt_steps)
        self.faults = FaultInjector()
        self.restart = RestartInfo()
        self.publisher = WeightPublisher(cfg, self.runtime, self.source.probe(),
                                         lambda: self.state.step + 1, self.faults)
        generator = Generator(self.runtime, self.publisher)
        self.episodes = (None if env_pool is None else MultiTurnGenerator.from_config(
            cfg, generator, self.source.tokenizer, env_pool))
        self.evaluator = Evaluator(cfg, self.source, self.runtime.rollout, self.publisher,
                                   reward_pool=self.rewards.pool, episodes=self.episodes)
        self.pipeline = RolloutPipeline(
            cfg, self.source, self.episodes or generator,
            SamplingParams.from_rollout(cfg.rollout,
                                        return_routing=cfg.algorithm.routing_replay == "r3"),
            stop,
            checkpoint_seconds=lambda: self.checkpointer.last_seconds)
        self.scorer = BatchScorer(cfg, self.source, self.rewards,
                                  None if self.episodes is None else self.env_scorer,
                                  self.pipeline, stop, lambda: self.publisher.weight_version)
        self.checkpointer = Checkpointer(
            cfg, self.runtime.trainer,
            [self.state, self.publisher, self.evaluator, self.rewards, self.env_scorer],
            self.source, self.pipeline, resume_hash(cfg), resume_hashes(cfg))
        self._busy_before = 0.0

    def start(self, resume: bool, force: bool, restart: RestartInfo) -> None:
        """Restore the latest checkpoint (if `resume`), bring the engines to the trainer's
        weights, and complete the record of the step a stop left without its evaluation."""
        self.restart = restart
        path = self.checkpointer.load_latest(force) if resume else None
        state = self.state
        if path is not None:
            log.info("resumed from %s (step %d, weight version %d)", path, state.step,
                     self.publisher.weight_version)
            say(f"resuming {self.cfg.run_dir} from checkpoint step {state.step}")
        self.recorder.open(state.step, resumed=path is not None, restart=restart)
        # Engines start from the model directory: bring them to the trainer's exact weights.
        self.publisher.publish(self.publisher.weight_version)
        owed = self.evaluator.evaluate_pending()
        if owed is not None:
            self.recorder.log(*owed)
            say(f"evaluated step {owed[0]} (skipped by the stop): pass@1 "
                f"{owed[1].get('eval/pass1', float('nan')):.3f}")
        self.recorder.rewind_jsonl(state.step, complete=owed)

    def train(self) -> RunResult:
        cfg, state, stop = self.cfg, self.state, self.stop
        result = RunResult(status="done", step=state.step, run_dir=str(cfg.run_dir))
        if state.step == 0 and cfg.eval.at_start and state.warm_start_accuracy is None:
            metrics = self.evaluator.evaluate(step=0)
            state.warm_start_accuracy = metrics.get("eval/pass1")
            self.recorder.log(0, metrics)
        self._busy_before = self.publisher.busy_seconds()
        while state.step < cfg.num_steps and not stop.requested:
            try:
                outcome = self.step(state.step + 1, result)
            except Exception as e:
                e.rl_step = state.step + 1  # type: ignore[attr-defined]  # the step that failed (`job.failures`)
                raise
            if outcome != "trained":
                result.status = "aborted" if outcome == "aborted" else result.status
                break
        if result.status == "done" and self.checkpointer.last_saved_step != state.step:
            self.checkpointer.save()  # the last step, or the step a stop ended on
        if stop.requested and result.status == "done":
            result.status = "stopped"
        result.step = state.step
        result.warm_start_accuracy = state.warm_start_accuracy
        result.final_accuracy = self.evaluator.last.get("eval/pass1")
        result.eval_problems = len(self.source.eval_set)
        result.final_mean_accuracy, result.final_mean_steps = mean_of_last_evals(
            read_metrics_jsonl(cfg.run_dir / "metrics.jsonl"))
        return result

    def step(self, step: int, result: RunResult) -> StepOutcome:
        """One RL step: `trained`, `abandoned` (a stop before training: nothing changed) or
        `aborted` (too many non-finite steps in a row; checkpointed)."""
        t_step = time.perf_counter()
        seconds = PhaseSeconds()
        # 1-4. the rollout batch, its rewards and advantages; until training starts, a stop
        #      abandons the step (nothing persistent changed yet)
        scored = self._rollout_and_score(step, seconds)
        if scored is None:
            return "abandoned"
        # 5. train, while the engines generate ahead (a step that has started is finished, then
        #    checkpointed: the trainer ranks cannot be interrupted)
        train_batch, trained = self._train(step, scored, seconds)
        # 6. the generations in flight end, then the weight update trainer -> rollout
        sync_stats = self._collect_and_publish(seconds)
        # 7. periodic evaluation
        metrics = self._evaluate(step, seconds)
        # 8. log, trajectories, checkpoint
        self.state.step = step
        seconds.step = time.perf_counter() - t_step
        self._record(step, result, metrics, scored, train_batch, trained, sync_stats, seconds)
        return self._checkpoint(step)

    def _rollout_and_score(self, step: int, seconds: PhaseSeconds) -> ScoredBatch | None:
        """The step's rollout batch, scored; None when a stop abandoned the step (the prompt
        sampler and the counters are back where they were)."""
        cfg, state, stop, pipe = self.cfg, self.state, self.stop, self.pipeline
        before = (self.source.state_dict(), self.rewards.failures, state.dropped_samples,
                  self.env_scorer.failures)
        try:
            # 1. the step's rollout batch: generated ahead (max_staleness >= 1) or now; a dead
            #    engine is restarted, re-synced, and the generation retried
            t0 = time.perf_counter()
            batch = pipe.take(step)
            seconds.rollout = time.perf_counter() - t0
            # 2. samples older than max_staleness are dropped (e.g. after lowering it on resume)
            batch, dropped = pipe.drop_stale(batch, self.publisher.weight_version)
            state.dropped_samples += dropped
            # 3. the next steps' batches start generating with the current weights (after
            #    dynamic sampling's refill rounds, which need the engines first)
            refills = cfg.algorithm.dynamic_sampling
            if not refills:
                pipe.launch_ahead(step, cfg.num_steps)
            # 4. rewards, dynamic sampling's refill rounds, advantages
            scored = self.scorer.score(step, batch)
            seconds.reward, seconds.rollout = (scored.reward_seconds,
                                               seconds.rollout + scored.refill_seconds)
            if refills:
                pipe.launch_ahead(step, cfg.num_steps)
            if stop.requested:
                raise StepAbandoned("stop requested before training")
        except StepAbandoned as e:
            log.warning("step %d abandoned (%s); checkpointing step %d", step, e, state.step)
            pipe.abandon()
            self.source.load_state_dict(before[0])
            self.rewards.failures, state.dropped_samples = before[1], before[2]
            self.env_scorer.failures = before[3]
            return None
        return scored

    def _train(self, step: int, scored: ScoredBatch,
               seconds: PhaseSeconds) -> tuple[TrainBatch, TrainStats]:
        """One training step on the trainer ranks; counts the non-finite steps."""
        state = self.state
        t0 = time.perf_counter()
        train_batch = TrainBatch.from_samples(
            scored.samples, scored.adv,
            routing=self.pipeline.sampling.return_routing)  # what the engines were asked for
        self.faults.before_train(step, self.restart.count, self.runtime)  # tests only
        trained = self.runtime.trainer.train(train_batch, step)
        seconds.train = time.perf_counter() - t0
        # the ranks skipped (together) any optimizer step with a non-finite loss or gradient
        bad = trained.skipped > 0
        state.bad_in_a_row = state.bad_in_a_row + 1 if bad else 0
        state.skipped_steps += int(bad)
        return train_batch, trained

    def _collect_and_publish(self, seconds: PhaseSeconds) -> dict:
        """The generations in flight end (finished, or cut at the interrupt budget) before the
        online weight update trainer -> rollout. After a stop they are awaited only as long as
        checkpoint.grace_period_s allows, and the update is left to the resumed run (which
        syncs the engines at its start). Returns the sync's statistics."""
        t0 = time.perf_counter()
        self.pipeline.collect()
        seconds.rollout += time.perf_counter() - t0
        t0 = time.perf_counter()
        if self.stop.requested:
            self.publisher.weight_version, sync_stats = self.publisher.weight_version + 1, {}
        else:
            sync_stats = self.publisher.publish(self.publisher.weight_version + 1)
        seconds.sync = time.perf_counter() - t0
        return sync_stats

    def _evaluate(self, step: int, seconds: PhaseSeconds) -> dict:
        """The eval/ metrics when an evaluation is due. After a stop the checkpoint goes first:
        the resumed run evaluates this step's weights at its start and completes its record."""
        stop = self.stop
        t0 = time.perf_counter()
        metrics = {}
        if self.evaluator.due(step) and not stop.requested:
            # a stop during its scoring leaves it to the resumed run, like a stop before it
            metrics.update(self.evaluator.evaluate(step, cancelled=lambda: stop.requested))
        elif self.evaluator.due(step):
            self.evaluator.pending = step
        seconds.eval = time.perf_counter() - t0
        return metrics

    def _record(self, step: int, result: RunResult, metrics: dict, scored: ScoredBatch,
                train_batch: TrainBatch, trained: TrainStats, sync_stats: dict,
                seconds: PhaseSeconds) -> None:
        """The step's metrics (after `metrics`, the evaluation's) to metrics.jsonl, TensorBoard,
        the trajectory file, the console and `result.history`."""
        busy = self.publisher.busy_seconds()
        cfg, sampling = self.cfg, scored.sampling
        self.state.generated_tokens += sampling.tokens
        metrics.update(trained.metrics)
        metrics.update(rollout_metrics(scored.samples, scored.parts, scored.batch.seconds,
                                       cfg.rollout.n_samples, self.rewards.failures,
                                       tokens=sampling.tokens))
        metrics["reward/overlong_penalty"] = scored.overlong_penalty
        metrics.update(sampling.metrics(self.state.generated_tokens))
        metrics.update(self._step_metrics(scored, sync_stats, seconds, busy))
        if self.episodes is not None:
            metrics.update(episode_metrics(scored.samples))
            metrics["env/failures"] = float(self.env_scorer.failures)
        self._busy_before = busy
        self.recorder.histogram(step, "rollout/staleness", scored.lags)
        self.recorder.record(step, metrics, scored.batch, scored.parts, scored.adv,
                             trained.old_logprobs_in_order(len(train_batch)), scored.lags)
        result.history.append({"step": step, **metrics})

    def _step_metrics(self, scored: ScoredBatch, sync_stats: dict, seconds: PhaseSeconds,
                      busy: float) -> dict[str, float]:
        """The loop's own sync/, weights/, rollout/, trainer/, faults/ and time/ metrics
        (`busy`: the engines' busy seconds so far)."""
        state, lags, samples, t_total = self.state, scored.lags, scored.samples, seconds.step
        return {"sync/seconds": sync_stats.get("seconds", 0.0),
                "sync/gbytes_per_s": sync_stats.get("gbytes_per_s", 0.0),
                "sync/bytes": float(sync_stats.get("bytes", 0)),
                **({"sync/logprob_max_diff": sync_stats["logprob_max_diff"]}
                   if "logprob_max_diff" in sync_stats else {}),
                "weights/version": float(self.publisher.weight_version),
                "rollout/staleness_mean": statistics.fmean(lags) if lags else 0.0,
                "rollout/staleness_max": float(max(lags, default=0)),
                "rollout/dropped_samples": float(state.dropped_samples),
                "rollout/resumed_frac": sum(len(s.version_spans) > 1 for s in samples)
                / max(len(samples), 1),
                # (an engine restarted this step starts its busy count at 0: clamp)
                "rollout/idle_ratio": min(1.0, max(0.0, 1.0 - (busy - self._busy_before)
                                                   / t_total)),
                "trainer/idle_ratio": max(0.0, 1.0 - (seconds.train + seconds.sync) / t_total),
                "faults/rollout_restarts": float(self.publisher.restarts),
                "faults/skipped_steps": float(state.skipped_steps),
                **seconds.metrics()}

    def _checkpoint(self, step: int) -> StepOutcome:
        """Save when due or stopping; abort (with a checkpoint) after too many non-finite steps
        in a row."""
        state = self.state
        if state.bad_in_a_row >= self.cfg.checkpoint.max_bad_steps:
            log.error("%d non-finite steps in a row: aborting with a checkpoint",
                      state.bad_in_a_row)
            self.checkpointer.save()
            return "aborted"
        if self.stop.requested or self.checkpointer.due(step):
            self.checkpointer.save()
        return "trained"

    def close(self, failed: bool = False, status: RunStatus | None = None) -> None:
        """`failed`: the run ends with an error; its workers are killed, not asked to stop.
        `status`: how it ended otherwise (the trackers record it)."""
        self.recorder.close("failed" if failed else status or "done")
        self.rewards.close()
        if self.episodes is not None:
            self.episodes.close()
        self.runtime.shutdown(failed)

"""Everything a run holds besides the loop itself: run directory, data, rewards, the runtime,
logging, trajectories, checkpoints, and resume.
"""
from __future__ import annotations

import json
import logging
import os
import random
import signal
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import yaml

from rl.checkpoint import CheckpointManager
from rl.config import Config, ConfigError, save_config, to_dict
from rl.console import say
from rl.data.datasets import build_datasets, prompt_ids
from rl.data.sampler import PromptSampler
from rl.evaluate import evaluate
from rl.faults import FaultInjector
from rl.metrics.tensorboard import MetricsLogger
from rl.metrics.trajectories import TrajectoryWriter
from rl.rewards.computer import RewardComputer
from rl.runtime import ActorDied, Runtime
from rl.sync.transport import SyncError

log = logging.getLogger(__name__)

# Keys that may change between a run and its resume without changing what it computes.
RESUME_IGNORED = ("name", "output_dir", "num_steps", "eval", "logging", "checkpoint", "cluster",
                  "sync.timeout_s", "sync.bucket_mb", "sync.verify", "trainer.torch_threads",
                  "rollout.cpu_kvcache_gb", "sft", "plan")


@dataclass(slots=True)
class DriverState:
    step: int = 0
    weight_version: int = 0
    warm_start_accuracy: float | None = None
    last_eval: dict = field(default_factory=dict)
    skipped_steps: int = 0
    bad_in_a_row: int = 0
    restarts_before: int = 0
    """Engine restarts in earlier lives of this run (before the last resume)."""
    reward_failures_before: int = 0
    dropped_samples: int = 0
    """Samples dropped for being older than algorithm.max_staleness (cumulative)."""
    eval_pending: int | None = None
    """A step whose evaluation a stop skipped (checkpoint first); the resumed run does it."""


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_differences(old: dict, new: dict) -> list[str]:
    a, b = _flatten(old), _flatten(new)
    keys = sorted(set(a) | set(b))
    ignored = lambda k: any(k == p or k.startswith(p + ".") for p in RESUME_IGNORED)  # noqa: E731
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys if a.get(k) != b.get(k) and not ignored(k)]


def resume_hash(cfg: Config) -> str:
    flat = {k: v for k, v in _flatten(to_dict(cfg)).items()
            if not any(k == p or k.startswith(p + ".") for p in RESUME_IGNORED)}
    import hashlib
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:16]


def setup_logging(run_dir: Path) -> None:
    root = logging.getLogger()
    if not any(isinstance(h, logging.FileHandler) and h.baseFilename == str(run_dir / "driver.log")
               for h in root.handlers):
        fh = logging.FileHandler(run_dir / "driver.log")
        fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(fh)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)


class RunContext:
    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg, self.run_dir = cfg, run_dir
        self.state = DriverState()
        self.last_saved_step: int | None = None
        self.ckpt = CheckpointManager(run_dir, cfg.checkpoint.keep_last, cfg.checkpoint.keep_every)
        from rl.models.loading import load_tokenizer
        from rl.sft import warm_start_dir
        self.model_dir = warm_start_dir(cfg)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.train, self.eval_set = build_datasets(cfg.data, cfg.seed)
        self.eval_set = self.eval_set[: cfg.eval.num_prompts]
        self.train_prompt_ids = self._tokenize(self.train)
        self.eval_prompt_ids = self._tokenize(self.eval_set)
        self.sampler = PromptSampler(len(self.train), cfg.seed, cfg.data.shuffle)
        self.rewards = RewardComputer(cfg.reward)
        self.eval_rewards = RewardComputer(cfg.reward)
        self.runtime: Runtime | None = None
        self.faults = FaultInjector()
        self.metrics: MetricsLogger | None = None
        self.trajectories: TrajectoryWriter | None = None
        self.pending: list[dict] = []
        """Rollout batches generated ahead of their step, restored from the checkpoint."""

    def _tokenize(self, examples) -> list[list[int]]:
        keep = self.cfg.data.max_prompt_tokens
        return [prompt_ids(ex, self.tokenizer, self.cfg.data)[-keep:] for ex in examples]

    # ---- startup ---------------------------------------------------------------------------
    def start(self, resume: bool, force: bool) -> None:
        cfg = self.cfg
        found = self.ckpt.latest() if resume else None
        opt_steps = cfg.num_steps * cfg.trainer.ppo_epochs * cfg.trainer.num_mini_batches
        self.runtime = Runtime(cfg, str(self.model_dir), total_optimizer_steps=opt_steps)
        purge = None
        if found is not None:
            path, manifest = found
            if manifest.get("config_hash") != resume_hash(cfg) and not force:
                raise ConfigError(f"{self.run_dir}: refusing to resume from {path.name}: the config "
                                  "differs in keys that matter (see above; pass --force to override)")
            self.runtime.load(str(path / "trainer"), "ds")
            driver = torch.load(path / "driver.pt", weights_only=False)
            self.state = DriverState(**driver["state"])
            self.sampler.load_state_dict(driver["sampler"])
            self.pending = driver.get("pending", [])
            random.setstate(driver["python_rng"])
            torch.set_rng_state(driver["torch_rng"])
            self.rewards.failures = self.state.reward_failures_before
            self.last_saved_step = self.state.step
            purge = self.state.step + 1
            log.info("resumed from %s (step %d, weight version %d)", path, self.state.step,
                     self.state.weight_version)
            say(f"resuming {self.run_dir} from checkpoint step {self.state.step}")
        self.metrics = MetricsLogger(self.run_dir, enabled=cfg.logging.tensorboard, purge_step=purge)
        self.log(self.state.step, restart_metrics(self.run_dir))
        if cfg.logging.hdf5:
            self.trajectories = TrajectoryWriter(self.run_dir / "trajectories.h5")
            if found is not None:
                self.trajectories.truncate(self.state.step)
        self._truncate_metrics_jsonl(self.state.step)
        # Engines start from the model directory: bring them to the trainer's exact weights.
        self.sync(self.state.weight_version)
        if self.state.eval_pending is not None:
            self._evaluate_pending()

    def _evaluate_pending(self) -> None:
        """The evaluation a stop skipped: the same weights (just restored and synced) and seed as
        the uninterrupted run's, merged into the step's metrics.jsonl line and logged at that
        step, so the record equals an uninterrupted run's."""
        step = self.state.eval_pending
        metrics = self.evaluate(step)
        self.log(step, metrics)
        path = self.run_dir / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        for i in range(len(lines) - 1, -1, -1):
            row = json.loads(lines[i])
            if row["step"] == step:
                lines[i] = json.dumps({**row, **metrics})
                break
        path.write_text("".join(line + "\n" for line in lines))
        self.state.eval_pending = None
        say(f"evaluated step {step} (skipped by the stop): pass@1 "
            f"{metrics.get('eval/pass1', float('nan')):.3f}")

    def _truncate_metrics_jsonl(self, step: int) -> None:
        path = self.run_dir / "metrics.jsonl"
        if path.exists():
            keep = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= step]
            path.write_text("".join(line + "\n" for line in keep))

    # ---- verbs the loop uses -----------------------------------------------------------------
    @property
    def step_in_progress(self) -> int:
        return self.state.step + 1

    def _with_engines(self, point: str, fn, step: int | None = None):
        """`fn()`, a call that needs every engine; if one died, it is restarted, brought to the
        current weights, and `fn` runs again (at most twice more). `point` names the call for
        fault injection (`rl.faults`)."""
        self.faults.at(point, self.step_in_progress if step is None else step, self.runtime)
        for attempt in range(3):
            try:
                return fn()
            except ActorDied as e:
                if attempt == 2:
                    raise
                log.warning("%s: a rollout engine died (%s); restarting it and retrying", point, e)
                self.runtime.restart_dead_engines(self.state.weight_version)

    def collect(self, gen, prompt_ids, sampling, seed, retries: int = 2):
        """(samples per prompt, seconds) of a generation in flight (`Runtime.generate_async`).

        A dead engine is restarted, brought to the trainer's weights, and the generation run
        again (the samples then carry the version the driver last published).
        """
        self.faults.at("generate", self.step_in_progress, self.runtime)
        for attempt in range(retries + 1):
            try:
                return gen.result(), gen.seconds
            except ActorDied as e:
                if attempt == retries:
                    raise
                log.warning("rollout failed (%s); restarting engines and retrying", e)
                self.runtime.restart_dead_engines(self.state.weight_version)
                gen = self.runtime.generate_async(prompt_ids, sampling, seed)

    def sync(self, version: int) -> dict:
        self.faults.at("sync", self.step_in_progress, self.runtime)
        try:
            stats = self.runtime.sync(version)
        except (ActorDied, SyncError) as e:
            # A rollout engine died (before or during the update): replace it; the replacement
            # is brought to `version` as part of the restart. Anything else is fatal.
            if not self.runtime.restart_dead_engines(version):
                raise
            log.warning("weight sync failed (%s); engines restarted and re-synced", e)
            stats = {"seconds": 0.0, "bytes": 0, "gbytes_per_s": 0.0}
        self.state.weight_version = version
        versions = self._with_engines("versions", self.runtime.engine_versions)
        if any(v != version for v in versions):
            raise RuntimeError(f"weight sync: engines report versions {versions}, expected {version}")
        if self.cfg.sync.check_logprobs:
            stats["logprob_max_diff"] = self.check_logprobs()
        return stats

    def engine_busy_seconds(self) -> float:
        return self._with_engines("busy_poll", self.runtime.engine_busy_seconds)

    def check_logprobs(self) -> float:
        """Max |trainer - engine| log-prob over a fixed probe sequence: proves the weights arrived."""
        ex = self.eval_set[0] if self.eval_set else self.train[0]
        prompt = self.eval_prompt_ids[0] if self.eval_set else self.train_prompt_ids[0]
        response = self.tokenizer(ex.answer, add_special_tokens=False)["input_ids"]
        response = response + [self.tokenizer.eos_token_id]
        ref = self.runtime.score_trainer([prompt], [response])[0]
        worst = 0.0
        scores = self._with_engines("probe",
                                    lambda: self.runtime.score_engines([prompt], [response]))
        for engine_scores in scores:
            worst = max(worst, max(abs(a - b) for a, b in zip(ref, engine_scores[0])))
        if worst > self.cfg.sync.check_logprobs_tol:
            raise RuntimeError(f"after the weight sync the rollout engine's log-probs differ from the "
                               f"trainer's by {worst:.2e} (> sync.check_logprobs_tol "
                               f"{self.cfg.sync.check_logprobs_tol:.0e}): the weights did not arrive intact")
        return worst

    def evaluate(self, step: int) -> dict:
        cfg = self.cfg
        metrics = self._with_engines("evaluate", lambda: evaluate(
            self.runtime, self.eval_prompt_ids, self.eval_set, self.eval_rewards, self.tokenizer,
            cfg.rollout.max_new_tokens, cfg.eval.pass_k, cfg.eval.pass_k_temperature,
            seed=10_007 + step), step=step)
        self.state.last_eval = metrics
        return metrics

    def rollout_metrics(self, samples, parts, seconds: float) -> dict:
        total = parts.total
        lengths = [len(s.response_ids) for s in samples]
        n = self.cfg.rollout.n_samples
        groups = [total[i:i + n] for i in range(0, len(total), n)]
        return {"reward/zero_std_frac": sum(max(g) == min(g) for g in groups) / len(groups),
                "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
                "reward/mean": statistics.fmean(total),
                "reward/std": statistics.pstdev(total) if len(total) > 1 else 0.0,
                "reward/failures": float(self.rewards.failures),
                "reward/format": statistics.fmean(parts.format),
                "rollout/accuracy": sum(c >= 1.0 for c in parts.correctness) / len(samples),
                "rollout/response_length": statistics.fmean(lengths),
                "rollout/tokens_per_s": sum(lengths) / max(seconds, 1e-9)}

    def log(self, step: int, metrics: dict) -> None:
        self.metrics.log(step, metrics)
        self.metrics.flush()

    def record(self, step, metrics, indices, groups, parts, adv, old_logprobs=None,
               lags=None) -> None:
        self.log(step, metrics)
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.trajectories is not None:
            samples = [s for g in groups for s in g]
            self.trajectories.append(
                step=step, weight_version=[s.weight_version for s in samples],
                prompt_index=[i for i, g in zip(indices, groups) for _ in g],
                prompt_ids=[s.prompt_ids for s in samples],
                response_ids=[s.response_ids for s in samples],
                rollout_logprobs=[s.logprobs for s in samples], reward=parts.total, advantage=adv,
                finish_reason=[s.finish_reason for s in samples], old_logprobs=old_logprobs,
                version_spans=[s.spans() for s in samples], staleness=lags,
                routing=[s.routing for s in samples] if self.cfg.logging.save_routing
                and all(s.routing is not None for s in samples) else None)
        last = step == self.cfg.num_steps
        if step % self.cfg.logging.print_every == 0 or last or "eval/pass1" in metrics:
            say(format_step(self.cfg, step, metrics))

    def save_checkpoint(self, pending: list[dict] = ()) -> Path:
        """`pending`: the rollout pipeline's batches generated ahead (`RolloutPipeline.state_dict`)."""
        state = self.state
        state.restarts_before += self.runtime.restarts
        self.runtime.restarts = 0
        state.reward_failures_before = self.rewards.failures

        def payload(tmp: Path) -> None:
            self.runtime.save(str(tmp / "trainer"), "ds", {"step": state.step})
            torch.save({"state": asdict(state), "sampler": self.sampler.state_dict(),
                        "pending": list(pending),
                        "python_rng": random.getstate(), "torch_rng": torch.get_rng_state()},
                       tmp / "driver.pt")

        path = self.ckpt.save(state.step, state.weight_version, resume_hash(self.cfg), payload)
        self.last_saved_step = state.step
        return path

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.runtime is not None:
            self.runtime.shutdown()


def restart_metrics(run_dir: Path) -> dict[str, float]:
    """What each start of a run logs to TensorBoard (at the step it starts from).

    `slurm/restart_count`: SLURM_RESTART_COUNT (0 outside Slurm). `slurm/requeue_signal`: the
    number of the signal that stopped this run's previous life, from the `reason` of the events
    `launch.job.lifecycle` appended to RUN_DIR/lifecycle.jsonl between the previous and the
    latest `start` (0 if none: a first start, or a life killed before it could record one).
    """
    events = []
    path = run_dir / "lifecycle.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a kill
    starts = [i for i, e in enumerate(events) if e.get("event") == "start"]
    previous = events[starts[-2] + 1: starts[-1]] if len(starts) >= 2 else []
    signum = 0
    for e in previous:
        if str(e.get("reason")) in signal.Signals.__members__:
            signum = int(signal.Signals[e["reason"]])
    return {"slurm/restart_count": float(os.environ.get("SLURM_RESTART_COUNT") or 0),
            "slurm/requeue_signal": float(signum)}


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
    if "eval/pass1" in m:
        parts.append(f"EVAL pass@1 {m['eval/pass1']:.3f}")
    parts.append(f"{m.get('time/step', 0):.1f}s")
    return " | ".join(parts)


def open_run(cfg: Config, resume: bool = True, force: bool = False) -> RunContext:
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(run_dir)
    saved = run_dir / "config.yaml"
    if saved.exists() and resume:
        old = yaml.safe_load(saved.read_text())
        diffs = config_differences(old, to_dict(cfg))
        if diffs and not force:
            raise ConfigError(f"{saved}: this run directory holds a run with a different config "
                              f"({'; '.join(diffs)}); use a new name or pass --force")
        if diffs:
            log.warning("resuming despite config differences (--force): %s", "; ".join(diffs))
    save_config(cfg, saved)
    ctx = RunContext(cfg, run_dir)
    try:
        ctx.start(resume, force)
    except BaseException:
        ctx.close()
        raise
    return ctx

"""A step's rollout batch -> rewards, dynamic sampling's refill rounds, GRPO advantages.

`BatchScorer.score` is steps 4 of the loop (`rl.loop.Run.step`): the rewards of the batch (the
environment's for multi-turn episodes, else the reward function's, plus the overlong penalty),
with algorithm.dynamic_sampling the refill rounds (`rl.dynamic_sampling`), then the advantages.
A stop during the scoring or a refill round raises `StepAbandoned`.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from rl.config import Config
from rl.data.source import PromptSource
from rl.dynamic_sampling import Round, SamplingStats, fill_batch, sample_penalties
from rl.envs.scoring import EnvScorer
from rl.pipeline import RolloutBatch, RolloutPipeline, staleness
from rl.rewards.computer import RewardBreakdown, RewardComputer
from rl.rollout.base import Sample
from rl.signals import StopRequest
from rl.trainer.losses import grpo_advantages


@dataclass(slots=True)
class ScoredBatch:
    """A step's rollout batch with its rewards and GRPO advantages: what training takes."""
    batch: RolloutBatch
    samples: list[Sample]
    lags: list[int]
    """Each sample's staleness (`rl.pipeline.staleness`)."""
    parts: RewardBreakdown
    """The rewards; `total` includes the overlong penalty."""
    adv: list[float]
    sampling: SamplingStats
    """How the batch was sampled (dynamic sampling's rounds)."""
    overlong_penalty: float
    """The mean overlong penalty in the trained samples' rewards [reward, <= 0]."""
    reward_seconds: float
    """Seconds spent scoring, every round."""
    refill_seconds: float
    """Seconds spent generating refill rounds."""


class BatchScorer:
    def __init__(self, cfg: Config, source: PromptSource, rewards: RewardComputer,
                 env_scorer: EnvScorer | None, pipeline: RolloutPipeline, stop: StopRequest,
                 weight_version: Callable[[], int]):
        """`env_scorer`: the episodes' rewards (multi-turn rollouts), None: `rewards` scores
        the responses; `weight_version`: the engines' weights now (for the samples' lags)."""
        self.cfg, self.source, self.rewards, self.env_scorer = cfg, source, rewards, env_scorer
        self.pipeline, self.stop, self.weight_version = pipeline, stop, weight_version

    def score(self, step: int, batch: RolloutBatch) -> ScoredBatch:
        cfg = self.cfg
        t0 = time.perf_counter()
        first = (batch, self.rewards_of(batch))
        spent = {"reward": time.perf_counter() - t0, "refill": 0.0}

        def refill(round_no: int, k: int) -> Round:
            t0 = time.perf_counter()
            more = self.pipeline.refill(step, round_no, k)
            t1 = time.perf_counter()
            scored = (more, self.rewards_of(more))
            spent["refill"] += t1 - t0
            spent["reward"] += time.perf_counter() - t1
            return scored

        batch, parts, sampling = fill_batch(first, refill, cfg.algorithm)
        samples = batch.samples()
        lags = staleness(samples, self.weight_version())
        rewards_G = torch.tensor(parts.total, dtype=torch.float32).view(len(batch.groups), -1)
        adv = grpo_advantages(rewards_G, cfg.algorithm.normalize_std).view(-1).tolist()
        penalty = statistics.fmean(sample_penalties(samples, cfg.response_budget, cfg.algorithm))
        return ScoredBatch(batch, samples, lags, parts, adv, sampling, penalty,
                           spent["reward"], spent["refill"])

    def rewards_of(self, batch: RolloutBatch) -> RewardBreakdown:
        """The batch's rewards, in sample order; the total includes the overlong penalty."""
        samples = batch.samples()
        if self.env_scorer is not None:  # the environment rewarded its episodes
            parts = self.env_scorer.score(samples)
        else:
            examples = [self.source.train[i] for i, g in zip(batch.indices, batch.groups)
                        for _ in g]
            parts = self.rewards.score([s.text for s in samples], examples,
                                       cancelled=lambda: self.stop.requested)
        penalties = sample_penalties(samples, self.cfg.response_budget, self.cfg.algorithm)
        parts.total = [t + p for t, p in zip(parts.total, penalties)]
        return parts

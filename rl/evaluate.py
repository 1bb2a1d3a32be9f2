"""Held-out evaluation: greedy pass@1, mean reward, and pass@k from k samples at temperature."""
from __future__ import annotations

import json
from pathlib import Path

from rl.data.example import Example
from rl.rewards.computer import RewardComputer
from rl.rollout.base import SamplingParams
from rl.signals import StepAbandoned


class Evaluator:
    """The periodic held-out evaluation: when it is due, running it (with engine recovery), and
    the evaluation a stop skipped, which the resumed run owes (`pending`)."""

    def __init__(self, cfg, source, rollout, publisher, reward_pool=None, episodes=None) -> None:
        """`source`: `rl.data.source.PromptSource`; `rollout`: `rl.cluster.facades.RolloutGroup`;
        `publisher`: `rl.publisher.WeightPublisher`; `reward_pool`: the training rewards'
        `rl.rewards.RewardPool`, shared (None: this evaluator starts its own); `episodes`: the
        run's `rl.envs.generator.MultiTurnGenerator` (multi-turn: the environment scores)."""
        self.cfg, self.source, self.rollout, self.publisher = cfg, source, rollout, publisher
        self.episodes = episodes
        # Its own failure count (reward/failures is the training samples'), the workers shared.
        self.rewards = RewardComputer(cfg.reward, pool=reward_pool)
        self.last: dict = {}
        """The metrics of the latest evaluation."""
        self.pending: int | None = None
        """A step whose evaluation a stop skipped (checkpoint first); the resumed run does it."""

    def due(self, step: int) -> bool:
        return bool(self.cfg.eval.every and step % self.cfg.eval.every == 0
                    or step == self.cfg.num_steps)

    def evaluate(self, step: int, cancelled=None) -> dict:
        """The metrics of evaluating the current weights as `step`'s. When `cancelled()` turns
        true while the responses are scored, {}: the evaluation is left `pending`."""
        cfg = self.cfg
        if self.episodes is not None:
            def run():
                return evaluate_episodes(
                    self.episodes.runner(cancelled or (lambda: False)), self.source.eval_ids,
                    self.source.eval_set, cfg.rollout.max_new_tokens, cfg.eval.pass_k,
                    cfg.eval.pass_k_temperature, seed=10_007 + step, cancelled=cancelled)
        else:
            def run():
                return evaluate(
                    self.rollout, self.source.eval_ids, self.source.eval_set, self.rewards,
                    self.source.tokenizer, cfg.rollout.max_new_tokens, cfg.eval.pass_k,
                    cfg.eval.pass_k_temperature, seed=10_007 + step, cancelled=cancelled)
        try:
            self.last = self.publisher.retry("evaluate", run, step=step)
        except StepAbandoned:
            self.pending = step
            return {}
        return self.last

    def evaluate_pending(self) -> tuple[int, dict] | None:
        """(step, metrics) of the evaluation a stop skipped: the same weights (restored and
        synced) and seed as the uninterrupted run's; None when none is owed."""
        if self.pending is None:
            return None
        step, self.pending = self.pending, None
        return step, self.evaluate(step)

    def state_dict(self) -> dict:
        return {"last_eval": self.last, "eval_pending": self.pending}

    def load_state_dict(self, state: dict) -> None:
        self.last, self.pending = state["last_eval"], state["eval_pending"]


def evaluate(rollout, prompt_ids: list[list[int]], examples: list[Example], rewards: RewardComputer,
             tokenizer, max_new_tokens: int, pass_k: int, temperature: float, seed: int,
             cancelled=None) -> dict:
    """Eval metrics; {} without examples (evaluation off: nothing to score, no 0/0 accuracy).
    `cancelled`: see `RewardComputer.score` (StepAbandoned)."""
    if not examples:
        return {}
    greedy = rollout.generate(prompt_ids, SamplingParams(n=1, temperature=0.0, top_p=1.0, top_k=-1,
                                                         max_new_tokens=max_new_tokens, seed=seed), seed)
    texts = [s[0].text for s in greedy]
    parts = rewards.score(texts, examples, cancelled)
    out = {"eval/pass1": sum(c >= 1.0 for c in parts.correctness) / max(len(examples), 1),
           "eval/mean_reward": sum(parts.total) / max(len(examples), 1)}
    if pass_k > 1:
        sampled = rollout.generate(prompt_ids, SamplingParams(
            n=pass_k, temperature=temperature, top_p=1.0, top_k=-1,
            max_new_tokens=max_new_tokens, seed=seed + 1), seed + 1)
        flat_texts = [s.text for group in sampled for s in group]
        flat_examples = [ex for ex, group in zip(examples, sampled) for _ in group]
        corr = rewards.score(flat_texts, flat_examples, cancelled).correctness
        hits = 0
        for i in range(len(examples)):
            hits += any(c >= 1.0 for c in corr[i * pass_k:(i + 1) * pass_k])
        out["eval/pass_k"] = hits / max(len(examples), 1)
    return out


def evaluate_episodes(runner, prompt_ids: list[list[int]], examples: list[Example],
                      max_new_tokens: int, pass_k: int, temperature: float, seed: int,
                      cancelled=None) -> dict:
    """`evaluate` for multi-turn episodes (`runner`: `rl.envs.episodes.EpisodeRunner`): the
    environment's reward decides (>= 1 is a pass); also `eval/` turns and tool-call rates."""
    from rl.envs.generator import example_row
    from rl.envs.scoring import episode_metrics
    if not examples:
        return {}
    rows = [example_row(ex) for ex in examples]
    greedy = runner.run(prompt_ids, rows, SamplingParams(
        n=1, temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=max_new_tokens, seed=seed),
        seed, cancelled)
    samples = [g[0] for g in greedy]
    rewards = [s.env_reward or 0.0 for s in samples]
    out = {"eval/pass1": sum(r >= 1.0 for r in rewards) / len(examples),
           "eval/mean_reward": sum(rewards) / len(examples),
           "eval/env_failures": float(sum(s.env_error is not None for s in samples)),
           **episode_metrics(samples, "eval/")}
    if pass_k > 1:
        sampled = runner.run(prompt_ids, rows, SamplingParams(
            n=pass_k, temperature=temperature, top_p=1.0, top_k=-1,
            max_new_tokens=max_new_tokens, seed=seed + 1), seed + 1, cancelled)
        out["eval/pass_k"] = sum(any((s.env_reward or 0.0) >= 1.0 for s in g)
                                 for g in sampled) / len(examples)
    return out


FINAL_EVALS = 3
"""How many of the last evaluations the final accuracy averages: a single evaluation of a few
hundred problems moves by a few points from one to the next, so it overstates or hides a gain."""


def mean_of_last_evals(rows: list[dict], k: int = FINAL_EVALS) -> tuple[float | None, list[int]]:
    """(mean held-out pass@1 of the last `k` evaluations, their steps); fewer when the run had
    fewer, (None, []) when it had none. `rows` are metrics.jsonl records (`step`, `eval/pass1`)."""
    evals = sorted((r["step"], r["eval/pass1"]) for r in rows if "eval/pass1" in r)[-k:]
    if not evals:
        return None, []
    return sum(acc for _, acc in evals) / len(evals), [step for step, _ in evals]


def read_metrics_jsonl(path: Path) -> list[dict]:
    """The records of a run's metrics.jsonl (all its lives: resume truncates it to the checkpoint)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

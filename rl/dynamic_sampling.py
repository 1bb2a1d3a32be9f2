"""DAPO's dynamic sampling and soft overlong penalty (Yu et al. 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale"; verl's `algorithm.filter_groups` and
`reward_model.overlong_buffer`).

Dynamic sampling (`algorithm.dynamic_sampling`): a prompt group whose rewards are all equal has
zero GRPO advantage in every sample, so it adds tokens to the batch but no policy gradient (and
with token-level loss aggregation it dilutes the other groups' gradient). After scoring, such
groups are dropped and the step draws more prompts, generates them with the current weights and
scores them, round after round, until the batch holds `prompts_per_step` groups whose rewards
differ or `max_gen_rounds` rounds were generated. "All equal" is on the total reward the
advantages are computed from (after the overlong penalty), the test `grpo_advantages` uses.

Choices where verl differs:
- a refill round draws exactly the groups the batch still lacks (verl draws a whole generation
  batch each round and truncates the surplus), so no group with a reward spread is generated and
  thrown away; the price is more rounds when many groups are dropped;
- when `max_gen_rounds` rounds leave the batch short (verl raises), the dropped groups fill it in
  the order they were generated: the step trains on what it would have trained on without
  dynamic sampling in their place (zero advantage), the batch keeps its size, and the padding is
  counted (`sampling/padded_groups`).

Determinism and resume: round r >= 1 of step s samples with `refill_seed(seed, s, r)` and draws
its prompts from the run's sampler, after the step's first-round prompts and before the prompts
of batches launched ahead (with `max_staleness >= 1` the refill rounds run before the next
batches are launched; they need the engines). Refill rounds happen before the step trains, so a
stop during them abandons the step and rewinds the sampler like any stop before training, and the
checkpoint after the step holds the sampler past every prompt they drew: a resumed run draws and
generates exactly what the uninterrupted one did. With `max_staleness >= 1` the first round was
generated ahead (its staleness as usual) and the refill rounds with the current weights.

The overlong penalty (`algorithm.overlong_buffer` > 0) lowers the training reward of a response
longer than `budget - overlong_buffer` tokens linearly, to `-overlong_penalty_factor` at
`budget` (`Config.response_budget`: rollout.max_new_tokens, or a multi-turn episode's
env.max_response_tokens); evaluation scores are not penalised.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, fields
from typing import Callable

from rl.config import AlgorithmConfig
from rl.pipeline import RolloutBatch
from rl.rewards.computer import RewardBreakdown

Round = tuple[RolloutBatch, RewardBreakdown]
"""One generation round, scored: the batch and its per-sample rewards (in batch order)."""


def overlong_penalties(lengths: list[int], max_new_tokens: int, buffer: int,
                       factor: float) -> list[float]:
    """DAPO's soft overlong punishment of each response length [tokens] -> reward [<= 0]:
    0 up to `max_new_tokens - buffer` tokens, then linear down to `-factor` at `max_new_tokens`
    (verl: `min(-(length - (max_new_tokens - buffer)) / buffer * factor, 0)`). `buffer` 0: all 0."""
    if buffer == 0:
        return [0.0] * len(lengths)
    start = max_new_tokens - buffer
    return [-factor * max(0, n - start) / buffer for n in lengths]


def sample_penalties(samples: list, max_new_tokens: int, cfg: AlgorithmConfig) -> list[float]:
    """`overlong_penalties` of each `rl.rollout.base.Sample` under `cfg`'s buffer and factor."""
    return overlong_penalties([len(s.response_ids) for s in samples], max_new_tokens,
                              cfg.overlong_buffer, cfg.overlong_penalty_factor)


def zero_spread(groups: list[list], totals: list[float]) -> list[bool]:
    """Per group: True when all its samples' rewards are equal (`totals` in batch order)."""
    out, at = [], 0
    for g in groups:
        chunk = totals[at:at + len(g)]
        out.append(max(chunk) == min(chunk))
        at += len(g)
    return out


@dataclass(slots=True)
class SamplingStats:
    """How a step's batch was sampled: its `sampling/*` metrics."""
    rounds: int = 1
    kept: int = 0
    """Trained groups whose rewards differ."""
    dropped: int = 0
    """Groups generated for the step and not trained on (all rewards equal)."""
    padded: int = 0
    """Groups with equal rewards trained on because max_gen_rounds left the batch short."""
    tokens: int = 0
    """Response tokens of every sample generated for the step, every round."""
    rewards: list[float] | None = None
    """Every generated sample's total reward, every round."""

    def metrics(self, tokens_total: int) -> dict[str, float]:
        """`tokens_total`: generated tokens over the whole run, this step's included."""
        return {"sampling/gen_rounds": float(self.rounds),
                "sampling/kept_groups": float(self.kept),
                "sampling/dropped_groups": float(self.dropped),
                "sampling/padded_groups": float(self.padded),
                "sampling/generated_tokens": float(self.tokens),
                "sampling/generated_tokens_total": float(tokens_total),
                "sampling/reward_mean": statistics.fmean(self.rewards) if self.rewards else 0.0}


@dataclass(frozen=True, slots=True)
class _Group:
    round: int
    index: int
    """Position of the group in its round's batch."""
    start: int
    """Position of its first sample in the round's samples."""
    size: int


def _split(rounds: list[Round], r: int) -> tuple[list[_Group], list[_Group]]:
    """Round r's groups: (with a reward spread, without)."""
    batch, parts = rounds[r]
    spread: list[_Group] = []
    flat: list[_Group] = []
    at = 0
    for i, (g, equal) in enumerate(zip(batch.groups, zero_spread(batch.groups, parts.total))):
        (flat if equal else spread).append(_Group(r, i, at, len(g)))
        at += len(g)
    return spread, flat


def _assemble(rounds: list[Round], chosen: list[_Group]) -> Round:
    """One batch of the `chosen` groups, in that order, with their rewards."""
    first = rounds[0][0]
    batch = RolloutBatch(step=first.step, ahead=first.ahead,
                         indices=[rounds[g.round][0].indices[g.index] for g in chosen],
                         groups=[rounds[g.round][0].groups[g.index] for g in chosen],
                         seconds=sum(b.seconds for b, _ in rounds))
    rows = [(g.round, i) for g in chosen for i in range(g.start, g.start + g.size)]
    parts = RewardBreakdown(**{f.name: [getattr(rounds[r][1], f.name)[i] for r, i in rows]
                               for f in fields(RewardBreakdown)})
    return batch, parts


def fill_batch(first: Round, refill: Callable[[int, int], Round], cfg: AlgorithmConfig
               ) -> tuple[RolloutBatch, RewardBreakdown, SamplingStats]:
    """The step's batch from its `first` round and, with `cfg.dynamic_sampling`, refill rounds:
    `refill(r, k)` generates and scores round r (1, 2, ...) of k more prompts. Without dynamic
    sampling `first` is returned as it is, with its statistics."""
    rounds = [first]
    kept, dropped = _split(rounds, 0)
    if cfg.dynamic_sampling:
        want = cfg.prompts_per_step
        while len(kept) < want and len(rounds) < cfg.max_gen_rounds:
            rounds.append(refill(len(rounds), want - len(kept)))
            more, flat = _split(rounds, len(rounds) - 1)
            kept, dropped = kept + more, dropped + flat
        padding = dropped[:max(0, want - len(kept))]
        batch, parts = _assemble(rounds, kept[:want] + padding)
        stats = SamplingStats(rounds=len(rounds), kept=min(len(kept), want),
                              dropped=len(dropped) - len(padding), padded=len(padding))
    else:
        batch, parts = first
        stats = SamplingStats(kept=len(kept))
    stats.tokens = sum(len(s.response_ids) for b, _ in rounds for s in b.samples())
    stats.rewards = [t for _, p in rounds for t in p.total]
    return batch, parts, stats

"""The batch one training step consumes: the driver builds it, every trainer rank receives it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class TrainBatch:
    """N samples in the driver's order (prompt groups of n_samples, groups in prompt order).

    Per-sample lists have length N; per-token lists are aligned with `response_ids[i]`.
    """
    prompt_ids: list[list[int]]
    """Prompt token ids of each sample."""
    response_ids: list[list[int]]
    """Generated token ids of each sample."""
    rollout_logprobs: list[list[float]]
    """The rollout engine's log-prob of each response token (per token)."""
    advantages: list[float]
    """One advantage per sample (GRPO: group-normalised reward)."""
    # ---- optional per-token extras -----------------------------------------------------------
    # Each is None when the run does not produce it, else N per-token lists aligned with
    # response_ids. Declare it here with a None default and list its name in PER_TOKEN_EXTRAS:
    # the lengths are then checked like rollout_logprobs'.
    routing: list | None = None
    """Routing replay (r3): per sample the rollout engine's expert ids, (prompt + response - 1,
    layers, top_k) uint8/uint16 (`rl.rollout.routing`); it covers prompt positions too, so it is
    not a per-token extra: `rl.rollout.routing.check_routing` checks its shape per sample."""
    loss_mask: list | None = None
    """Multi-turn (rl/envs/): per sample, per response token 1 where the model sampled it and 0
    for environment tokens (tool results). The loss, KL, entropy and TIS count only tokens
    with 1; environment tokens are context. None = every response token counts."""

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
        for name in ("response_ids", "rollout_logprobs", "advantages"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"train batch: {len(getattr(self, name))} {name} for {n} prompts")
        for name in ("rollout_logprobs", *PER_TOKEN_EXTRAS):
            rows = getattr(self, name)
            if rows is None:
                continue
            if len(rows) != n:
                raise ValueError(f"train batch: {len(rows)} rows of {name} for {n} samples")
            for i, (row, resp) in enumerate(zip(rows, self.response_ids)):
                if len(row) != len(resp):
                    raise ValueError(f"train batch: sample {i} has {len(row)} {name} for "
                                     f"{len(resp)} response tokens")

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @classmethod
    def from_samples(cls, samples, advantages: list[float], routing: bool = False) -> TrainBatch:
        """From rollout `Sample`s (rl.rollout.base), in batch order; `routing`: carry theirs."""
        masked = any(s.loss_mask is not None for s in samples)
        return cls(prompt_ids=[s.prompt_ids for s in samples],
                   response_ids=[s.response_ids for s in samples],
                   rollout_logprobs=[s.logprobs for s in samples], advantages=list(advantages),
                   routing=[s.routing for s in samples] if routing else None,
                   loss_mask=[s.loss_mask if s.loss_mask is not None
                              else [1] * len(s.response_ids) for s in samples]
                   if masked else None)

    def lengths(self) -> list[int]:
        """Prompt + response tokens of each sample."""
        return [len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids)]


PER_TOKEN_EXTRAS: tuple[str, ...] = ("loss_mask",)
"""Names of TrainBatch's optional per-token fields (declared under "optional per-token extras")."""


@dataclass(kw_only=True, slots=True)
class TrainStats:
    """What one training step returns: `TrainerWorker.train_step` on one rank, and
    `rl.cluster.facades.TrainerGroup.train` for all of them."""
    metrics: dict[str, float]
    """`train/<key>` metrics (`rollout/routing_agreement` too under routing replay r3), the same
    on every rank: means over ranks, true max/min for `*_max`/`*_min`, `train/tokens_per_s`
    summed over ranks (tags: rl/metrics/tensorboard.py)."""
    old_logprobs: dict[int, list[float]]
    """The trainer's log-prob of each response token before the update, by sample index into
    the step's batch: this rank's shard from a worker, every sample from the group."""

    @property
    def skipped(self) -> int:
        """Optimizer steps skipped (non-finite loss or gradients), the same on every rank."""
        return int(self.metrics["train/skipped"])

    def old_logprobs_in_order(self, num_samples: int) -> list[list[float]]:
        """`old_logprobs` in batch order (empty for a sample no rank reported)."""
        return [self.old_logprobs.get(i, []) for i in range(num_samples)]

"""Padding and token-budget micro-batching for the trainer.

Positions: a sequence is prompt + response, right-padded to the micro-batch's longest. Masks are
aligned with *input* positions; the loss uses `[:, 1:]` slices, aligned with next-token targets.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rl.trainer.batch import TrainBatch

PAD_ID = 0


@dataclass(slots=True)
class Micro:
    index: list[int]
    """Sample indices (into the step's batch) of the rows."""
    input_ids: torch.Tensor
    """(B, L) int64, right-padded."""
    attention_mask: torch.Tensor
    """(B, L) int64."""
    resp_mask: torch.Tensor
    """(B, L) float32: 1 where the input token is a response token."""
    rollout_logp: torch.Tensor
    """(B, L) float32: the rollout engine's log-prob of each response token, 0 elsewhere."""
    weight: float = 1.0
    """0 for padding micro-batches that only keep ZeRO's collectives in step."""


def pad_batch(prompt_ids: list[list[int]], response_ids: list[list[int]],
              rollout_logprobs: list[list[float]] | None = None, index: list[int] | None = None) -> Micro:
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
    B, L = len(lengths), max(lengths)
    ids = torch.full((B, L), PAD_ID, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    resp = torch.zeros((B, L), dtype=torch.float32)
    rlp = torch.zeros((B, L), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        n = len(p) + len(r)
        ids[i, :n] = torch.tensor(list(p) + list(r), dtype=torch.long)
        attn[i, :n] = 1
        resp[i, len(p):n] = 1.0
        if rollout_logprobs is not None:
            lp = rollout_logprobs[i]
            if len(lp) != len(r):
                raise ValueError(f"sample {i}: {len(lp)} rollout log-probs for {len(r)} response tokens")
            rlp[i, len(p):n] = torch.tensor(lp, dtype=torch.float32)
    return Micro(index=list(index) if index is not None else list(range(B)), input_ids=ids,
                 attention_mask=attn, resp_mask=resp, rollout_logp=rlp)


def split_by_budget(indices: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """Greedy, order-preserving: a group's (rows x longest row) stays within `budget` tokens."""
    groups: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in indices:
        new_longest = max(longest, lengths[i])
        if cur and (len(cur) + 1) * new_longest > budget:
            groups.append(cur)
            cur, new_longest = [], lengths[i]
        cur.append(i)
        longest = new_longest
    if cur:
        groups.append(cur)
    return groups


def micro_batches(batch: TrainBatch, mine: list[int], budget: int, world_size: int
                  ) -> list[Micro]:
    """This rank's micro-batches, padded with zero-weight copies up to the max over all ranks."""
    n, lengths = len(batch), batch.lengths()
    counts = [len(split_by_budget(list(range(r, n, world_size)), lengths, budget))
              for r in range(world_size)]
    out = []
    for group in split_by_budget(mine, lengths, budget):
        out.append(pad_batch([batch.prompt_ids[i] for i in group],
                             [batch.response_ids[i] for i in group],
                             [batch.rollout_logprobs[i] for i in group], index=group))
    if not out:  # fewer samples than ranks: still take part in the collectives
        out.append(pad_batch([batch.prompt_ids[0]], [batch.response_ids[0]],
                             [batch.rollout_logprobs[0]], index=[0]))
        out[0].weight = 0.0
    while len(out) < max(counts):
        filler = out[0]
        out.append(Micro(index=filler.index, input_ids=filler.input_ids,
                         attention_mask=filler.attention_mask, resp_mask=filler.resp_mask,
                         rollout_logp=filler.rollout_logp, weight=0.0))
    return out

"""Padding and token-budget micro-batching for the trainer.

Positions: a sequence is prompt + response, right-padded to the micro-batch's longest. Masks are
aligned with *input* positions; the loss uses `[:, 1:]` slices, aligned with next-token targets.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rl.rollout.routing import check_routing, pad_routing
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
    routing: torch.Tensor | None = None
    """(B, L, layers, K) int64 expert ids the rollout engine chose (`rl.rollout.routing`), zeros
    where it reported none; None when the batch carries no routing."""
    routing_mask: torch.Tensor | None = None
    """(B, L) bool: the positions `routing` covers (prompt + response but the last token)."""
    loss_mask: torch.Tensor | None = None
    """(B, L) float32: 1 where the input token is a response token the model sampled, 0 on
    environment tokens (multi-turn) and elsewhere; None = `resp_mask` (single-turn)."""

    @property
    def train_mask(self) -> torch.Tensor:
        """The positions the loss, KL, entropy and TIS count: `loss_mask`, else `resp_mask`."""
        return self.resp_mask if self.loss_mask is None else self.loss_mask


def pad_batch(prompt_ids: list[list[int]], response_ids: list[list[int]],
              rollout_logprobs: list[list[float]] | None = None, index: list[int] | None = None,
              routing: list | None = None, loss_mask: list | None = None) -> Micro:
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
    lmask = None
    if loss_mask is not None:
        lmask = torch.zeros((B, L), dtype=torch.float32)
        for i, (p, m) in enumerate(zip(prompt_ids, loss_mask)):
            if len(m) != len(response_ids[i]):
                raise ValueError(f"sample {i}: {len(m)} loss-mask entries for "
                                 f"{len(response_ids[i])} response tokens")
            lmask[i, len(p):len(p) + len(m)] = torch.tensor(m, dtype=torch.float32)
    routes = route_mask = None
    if routing is not None:
        for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
            if routing[i] is None:
                raise ValueError(f"sample {i} carries no routing (algorithm.routing_replay r3 "
                                 "needs it from the engine; was it generated with r3 off?)")
            check_routing(routing[i], len(p), len(r), f"sample {i}")
        routes, route_mask = pad_routing(list(routing), [0] * B, L)
    return Micro(index=list(index) if index is not None else list(range(B)), input_ids=ids,
                 attention_mask=attn, resp_mask=resp, rollout_logp=rlp, routing=routes,
                 routing_mask=route_mask, loss_mask=lmask)


def split_by_budget(indices: list[int], lengths: list[int], budget: int,
                    packed: bool = False) -> list[list[int]]:
    """Greedy, order-preserving groups whose tokens stay within `budget`: rows x the longest row
    (padded micro-batches), or with `packed` the sum of the rows' lengths (real tokens, the
    rule for packed micro-batches). A row over the budget is a group of its own."""
    groups: list[list[int]] = []
    cur: list[int] = []
    longest = total = 0
    for i in indices:
        new_longest, new_total = max(longest, lengths[i]), total + lengths[i]
        if cur and (new_total if packed else (len(cur) + 1) * new_longest) > budget:
            groups.append(cur)
            cur, new_longest, new_total = [], lengths[i], lengths[i]
        cur.append(i)
        longest, total = new_longest, new_total
    if cur:
        groups.append(cur)
    return groups


def micro_batches(batch: TrainBatch, mine: list[int], budget: int, world_size: int,
                  packed: bool = False) -> list[Micro]:
    """This rank's micro-batches, padded with zero-weight copies up to the max over all ranks.
    `packed` (`trainer.pack_sequences`): `budget` counts real tokens, else rows x the longest
    row (`split_by_budget`)."""
    n, lengths = len(batch), batch.lengths()
    counts = [len(split_by_budget(list(range(r, n, world_size)), lengths, budget, packed))
              for r in range(world_size)]
    routing, lmask = batch.routing, batch.loss_mask
    out = []
    for group in split_by_budget(mine, lengths, budget, packed):
        out.append(pad_batch([batch.prompt_ids[i] for i in group],
                             [batch.response_ids[i] for i in group],
                             [batch.rollout_logprobs[i] for i in group], index=group,
                             routing=[routing[i] for i in group] if routing else None,
                             loss_mask=[lmask[i] for i in group] if lmask else None))
    if not out:  # fewer samples than ranks: still take part in the collectives
        out.append(pad_batch([batch.prompt_ids[0]], [batch.response_ids[0]],
                             [batch.rollout_logprobs[0]], index=[0],
                             routing=routing[:1] if routing else None,
                             loss_mask=lmask[:1] if lmask else None))
        out[0].weight = 0.0
    while len(out) < max(counts):
        filler = out[0]
        out.append(Micro(index=filler.index, input_ids=filler.input_ids,
                         attention_mask=filler.attention_mask, resp_mask=filler.resp_mask,
                         rollout_logp=filler.rollout_logp, weight=0.0, routing=filler.routing,
                         routing_mask=filler.routing_mask, loss_mask=filler.loss_mask))
    return out


def loss_count(mb: Micro, loss_agg: str) -> float:
    """What `mb` adds to a mini-batch's loss denominator: its counted tokens (`token`) or its
    sequences with at least one (`sequence`); environment tokens never count."""
    mask = mb.train_mask[:, 1:]
    return float(mask.sum()) if loss_agg == "token" else float((mask.sum(1) > 0).sum())


def micro_policy_loss(logp: torch.Tensor, old: torch.Tensor, ref: torch.Tensor | None,
                      entropy: torch.Tensor, advantages_B: torch.Tensor, mb: Micro, algo,
                      denom: float) -> tuple[torch.Tensor, dict[str, float]]:
    """`rl.trainer.losses.policy_loss` of micro-batch `mb` (`logp`, `old`, `ref`, `entropy`:
    (B, L-1) on one device; `algo`: `AlgorithmConfig`): the loss, KL, entropy and TIS count
    the model's tokens only (`Micro.train_mask`), so environment tokens get no gradient."""
    from rl.trainer import losses
    mask = mb.train_mask[:, 1:].to(logp.device)
    rollout = mb.rollout_logp[:, 1:].to(logp.device)
    return losses.policy_loss(
        logp, old, advantages_B, mask, algo,
        rollout_logp=rollout if algo.tis_cap is not None else None,
        ref_logp=ref, entropy=entropy, agg_denominator=denom)

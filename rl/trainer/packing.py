"""Sequence packing for the trainer's forward (`trainer.pack_sequences`).

A padded micro-batch (`rl.trainer.microbatch.Micro`, rows right-padded to the longest) spends
compute on padding: RL responses vary widely in length. Packed, the rows are laid end to end in
bins as long as the micro-batch's longest row (first fit, in order), each row with its own
position ids 0..n-1 and a block-diagonal causal mask (a token sees the earlier tokens of its own
row only), so the model computes exactly what it computes per row. Bins rather than one long
sequence: the attention over a bin of C tokens costs C^2 whether its rows fill it or not (the
mask is dense: transformers' SDPA / eager attention compute every masked score), so one sequence
of all T tokens would cost T^2 where the padded rows cost B x L^2 (measured on CPU: 0.58x the
padded path's tokens/s, `bench.packing`). The log-probs (and entropies) come back in the padded
`(B, L-1)` layout the losses take (zeros where there is no next token of the row), so everything
after the forward is the padded path's.

The micro-batch budget then counts real tokens (`split_by_budget(..., packed=True)`) instead of
rows x longest. DeepSeek-V4 is not packed: its compressed attention pools blocks of consecutive tokens, which
would cross row boundaries (`check_packable`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Packed:
    input_ids: torch.Tensor
    """(N, C) int64: the bins, rows end to end, right-padded with 0."""
    position_ids: torch.Tensor
    """(N, C) int64: each row's positions 0..n-1 (0 on padding)."""
    attention_mask: torch.Tensor
    """(N, 1, C, C) bool: True where query t may attend key s (same row, s <= t; a padding
    position attends itself only, so that no query row is all masked)."""
    targets: torch.Tensor
    """(N, C-1) int64: the next token of each position (across a row's end: whatever follows,
    never read)."""
    rows: torch.Tensor
    """(M,) int64: the padded row of each next-token prediction inside a row."""
    cols: torch.Tensor
    """(M,) int64: its padded position (0..n-2)."""
    bins: torch.Tensor
    """(M,) int64: its bin."""
    at: torch.Tensor
    """(M,) int64: its position in the bin."""
    shape: tuple[int, int]
    """(B, L-1): the padded layout of the log-probs."""


def first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Row indices per bin: each row, in order, into the first bin it fits (`capacity` tokens)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        b = next((j for j, r in enumerate(room) if r >= n), None)
        if b is None:
            bins.append([])
            room.append(capacity)
            b = len(bins) - 1
        bins[b].append(i)
        room[b] -= n
    return bins


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor,
         device: torch.device | str | None = None) -> Packed:
    """The packed form of right-padded `input_ids` (B, L) with `attention_mask` (B, L), built
    on the host (the micro-batches live there) and put on `device` (default: the inputs')."""
    dev = input_ids.device if device is None else device
    input_ids, attention_mask = input_ids.cpu(), attention_mask.cpu()
    B, L = input_ids.shape
    if bool((attention_mask[:, :-1] < attention_mask[:, 1:]).any()):
        raise ValueError("pack: rows must be right-padded")
    lengths = attention_mask.sum(1).tolist()
    C = max(lengths)
    bins = first_fit(lengths, C)
    ids = torch.zeros(len(bins), C, dtype=input_ids.dtype)
    pos = torch.zeros(len(bins), C, dtype=torch.long)
    seg = torch.full((len(bins), C), -1, dtype=torch.long)
    rows: list[int] = []
    cols: list[int] = []
    where: list[int] = []
    at: list[int] = []
    for b, members in enumerate(bins):
        o = 0
        for i in members:
            n = lengths[i]
            ids[b, o:o + n] = input_ids[i, :n]
            pos[b, o:o + n] = torch.arange(n)
            seg[b, o:o + n] = i
            rows += [i] * (n - 1)
            cols += range(n - 1)
            where += [b] * (n - 1)
            at += range(o, o + n - 1)
            o += n
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)
    mask = same & torch.ones(C, C, dtype=torch.bool).tril()
    mask |= torch.eye(C, dtype=torch.bool) & (seg < 0)[:, :, None]
    def t(v: list[int]) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.long, device=dev)
    return Packed(input_ids=ids.to(dev), position_ids=pos.to(dev),
                  attention_mask=mask[:, None].to(dev), targets=ids[:, 1:].to(dev),
                  rows=t(rows), cols=t(cols), bins=t(where), at=t(at), shape=(B, L - 1))


def unpack(values: torch.Tensor, packed: Packed) -> torch.Tensor:
    """(N, C-1) per-position values of the bins -> (B, L-1), zeros where a row has no next
    token. Differentiable."""
    out = values.new_zeros(packed.shape)
    return out.index_put((packed.rows, packed.cols), values[packed.bins, packed.at])


def model_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor, packed: bool,
                 device: torch.device | str) -> tuple[dict, torch.Tensor, Packed | None]:
    """(the model's keyword arguments, the next token of each position, the `Packed` layout or
    None), on `device`, for right-padded host rows: packed (`pack`) or padded as they are.
    Position t predicts token t+1: response token j sits at input position P + j."""
    if not packed:
        input_ids = input_ids.to(device)
        return (dict(input_ids=input_ids, attention_mask=attention_mask.to(device),
                     use_cache=False), input_ids[:, 1:], None)
    p = pack(input_ids, attention_mask, device)
    return (dict(input_ids=p.input_ids, position_ids=p.position_ids,
                 attention_mask=p.attention_mask, use_cache=False), p.targets, p)


def check_packable(model_type: str) -> None:
    """ValueError naming trainer.pack_sequences for a model whose forward cannot be packed."""
    if model_type.startswith("deepseek_v4"):
        raise ValueError("trainer.pack_sequences: got true, expected false for DeepSeek-V4 (its "
                         "compressed attention pools blocks of consecutive tokens across rows)")

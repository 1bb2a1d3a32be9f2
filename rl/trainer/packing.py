"""Sequence packing for the trainer's forward (`trainer.pack_sequences`).

A padded micro-batch (`rl.trainer.microbatch.Micro`, rows right-padded to the longest) spends
compute on padding: RL responses vary widely in length. Packed, the rows' real tokens are laid
end to end in one sequence of `sum(lengths)` tokens, each row with its own position ids 0..n-1
and a block-diagonal causal attention mask (a token sees the earlier tokens of its own row only),
so the model computes exactly what it computes per row. The log-probs (and entropies) come back
in the padded `(B, L-1)` layout the losses take (zeros where there is no next token of the row),
so everything after the forward is the padded path's.

The micro-batch budget then counts real tokens (`split_by_tokens`) instead of rows x longest.
The mask is a dense `(1, 1, T, T)` boolean passed to transformers' SDPA / eager attention.
DeepSeek-V4 is not packed: its compressed attention pools blocks of consecutive tokens, which
would cross row boundaries (`check_packable`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Packed:
    input_ids: torch.Tensor
    """(1, T) int64: the rows' real tokens, end to end."""
    position_ids: torch.Tensor
    """(1, T) int64: each row's positions 0..n-1."""
    attention_mask: torch.Tensor
    """(1, 1, T, T) bool: True where query t may attend key s (same row, s <= t)."""
    targets: torch.Tensor
    """(1, T-1) int64: the next token of each packed position (across a row's end: the next
    row's first token, whose log-prob is never read)."""
    rows: torch.Tensor
    """(N,) int64: the padded row of each next-token prediction inside a row."""
    cols: torch.Tensor
    """(N,) int64: its padded position (0..n-2)."""
    at: torch.Tensor
    """(N,) int64: its packed position."""
    shape: tuple[int, int]
    """(B, L-1): the padded layout of the log-probs."""


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Packed:
    """The packed form of right-padded `input_ids` (B, L) with `attention_mask` (B, L)."""
    B, L = input_ids.shape
    lengths = attention_mask.sum(1).long()
    if bool((attention_mask[:, :-1] < attention_mask[:, 1:]).any()):
        raise ValueError("pack: rows must be right-padded")
    ids = input_ids[attention_mask.bool()]  # row-major: the rows end to end
    T = ids.numel()
    starts = torch.cumsum(lengths, 0) - lengths
    seg = torch.repeat_interleave(torch.arange(B, device=ids.device), lengths)
    pos = torch.arange(T, device=ids.device) - starts[seg]
    mask = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
    mask &= seg[:, None] == seg[None, :]
    inner = pos[:-1] < (lengths[seg[:-1]] - 1)  # packed positions whose next token is its row's
    at = torch.nonzero(inner).squeeze(1)
    return Packed(input_ids=ids[None], position_ids=pos[None], attention_mask=mask[None, None],
                  targets=ids[1:][None], rows=seg[at], cols=pos[at], at=at, shape=(B, L - 1))


def unpack(values: torch.Tensor, packed: Packed) -> torch.Tensor:
    """(1, T-1) per-position values of the packed sequence -> (B, L-1), zeros where a row has
    no next token. Differentiable."""
    out = values.new_zeros(packed.shape)
    return out.index_put((packed.rows, packed.cols), values[0, packed.at])


def model_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor, packed: bool
                 ) -> tuple[dict, torch.Tensor, Packed | None]:
    """(the model's keyword arguments, the next token of each position, the `Packed` layout or
    None) for right-padded rows: packed (`pack`) or padded as they are. Position t predicts
    token t+1: response token j sits at input position P + j."""
    if not packed:
        return (dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False),
                input_ids[:, 1:], None)
    p = pack(input_ids, attention_mask)
    return (dict(input_ids=p.input_ids, position_ids=p.position_ids,
                 attention_mask=p.attention_mask, use_cache=False), p.targets, p)


def check_packable(model_type: str) -> None:
    """ValueError naming trainer.pack_sequences for a model whose forward cannot be packed."""
    if model_type.startswith("deepseek_v4"):
        raise ValueError("trainer.pack_sequences: got true, expected false for DeepSeek-V4 (its "
                         "compressed attention pools blocks of consecutive tokens across rows)")

"""Sequence packing for the trainer's forward (`trainer.pack_sequences`).

A padded micro-batch (`rl.trainer.microbatch.Micro`, rows right-padded to the longest) spends
compute on padding: RL responses vary widely in length. Packed, the micro-batch's rows are laid
end to end in one sequence of their real tokens, each row with its own position ids 0..n-1,
and the cumulative row lengths (`cu_seq_lens_q`, FlashAttention's varlen convention) go to the
attention, which attends within each row only (`rl.models.varlen`; DeepSeek-V4's
`rl.models.v4_attention` runs its compressor, indexer and core row by row): the linear layers
and the MoE see only real tokens, the attention costs sum(n_i^2), and no (T x T) mask is built.
The log-probs (and entropies) come back in the padded `(B, L-1)` layout the losses take (zeros
where there is no next token of the row), so everything after the forward is the padded path's.

The micro-batch budget then counts real tokens (`split_by_budget(..., packed=True)`) instead of
rows x longest.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Packed:
    input_ids: torch.Tensor
    """(1, T) int64: the rows end to end (T: their total length)."""
    position_ids: torch.Tensor
    """(1, T) int64: each row's positions 0..n-1."""
    cu_seq_lens: torch.Tensor
    """(B+1,) int32: where each row starts (0, n_0, n_0 + n_1, ..., T)."""
    max_length: int
    """The longest row."""
    targets: torch.Tensor
    """(1, T-1) int64: the next token of each position (across a row's end: the next row's
    first token, never read)."""
    rows: torch.Tensor
    """(M,) int64: the padded row of each next-token prediction inside a row."""
    cols: torch.Tensor
    """(M,) int64: its padded position (0..n-2)."""
    at: torch.Tensor
    """(M,) int64: its position in the packed sequence."""
    shape: tuple[int, int]
    """(B, L-1): the padded layout of the log-probs."""

    def model_kwargs(self) -> dict:
        """The model's keyword arguments (transformers passes the cu_seq_lens / max_length ones
        down to every attention call)."""
        return dict(input_ids=self.input_ids, position_ids=self.position_ids, use_cache=False,
                    cu_seq_lens_q=self.cu_seq_lens, cu_seq_lens_k=self.cu_seq_lens,
                    max_length_q=self.max_length, max_length_k=self.max_length)


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor,
         device: torch.device | str | None = None) -> Packed:
    """The packed form of right-padded `input_ids` (B, L) with `attention_mask` (B, L), built
    on the host (the micro-batches live there) and put on `device` (default: the inputs')."""
    from rl.models import varlen
    dev = input_ids.device if device is None else device
    input_ids, attention_mask = input_ids.cpu(), attention_mask.cpu()
    B, L = input_ids.shape
    if bool((attention_mask[:, :-1] < attention_mask[:, 1:]).any()):
        raise ValueError("pack: rows must be right-padded")
    lengths = attention_mask.sum(1).tolist()
    if min(lengths) < 1:
        raise ValueError("pack: every row needs at least one token")
    ids = input_ids[attention_mask.bool()].view(1, -1)  # row-major: rows end to end
    pos = torch.cat([torch.arange(n) for n in lengths]).view(1, -1)
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    rows = torch.cat([torch.full((n - 1,), i, dtype=torch.long) for i, n in enumerate(lengths)])
    cols = torch.cat([torch.arange(n - 1) for n in lengths])
    at = torch.cat([torch.arange(int(cu[i]), int(cu[i]) + n - 1) for i, n in enumerate(lengths)])
    return Packed(input_ids=ids.to(dev), position_ids=pos.to(dev),
                  cu_seq_lens=varlen.with_bounds(cu.to(device=dev, dtype=torch.int32), cu),
                  max_length=max(lengths),
                  targets=ids[:, 1:].to(dev), rows=rows.to(dev), cols=cols.to(dev),
                  at=at.to(dev), shape=(B, L - 1))


def unpack(values: torch.Tensor, packed: Packed) -> torch.Tensor:
    """(1, T-1) per-position values of the packed sequence -> (B, L-1), zeros where a row has
    no next token. Differentiable."""
    out = values.new_zeros(packed.shape)
    return out.index_put((packed.rows, packed.cols), values[0, packed.at])


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
    return p.model_kwargs(), p.targets, p


def install(model) -> None:
    """Make `model`'s attention read packed rows (`rl.models.varlen`); DeepSeek-V4's attention
    (`rl.models.v4_attention`) reads them already."""
    if not model.config.model_type.startswith("deepseek_v4"):
        from rl.models import varlen
        varlen.install(model)


def check_packable(config: dict, attention_kernel: str = "auto") -> None:
    """ValueError naming trainer.pack_sequences for a model (its config.json as a dict) whose
    forward cannot be packed: sliding-window layers (`rl.models.varlen` has no window; V4's own
    attention has), or DeepSeek-V4 with transformers' eager attention
    (`trainer.attention_kernel: eager`), which would attend across rows."""
    from rl.models.attention import attention_kernel as kernel_of
    model_type = str(config.get("model_type", ""))
    if kernel_of(model_type, attention_kernel) == "eager":
        raise ValueError(f"trainer.pack_sequences: got true, expected false with "
                         f"trainer.attention_kernel {attention_kernel} for {model_type} "
                         "(transformers' eager attention would attend across packed rows)")
    if model_type.startswith("deepseek_v4"):  # rl.models.v4_attention: windows row by row
        return
    sliding = [t for t in config.get("layer_types") or [] if t == "sliding_attention"]
    if sliding or config.get("use_sliding_window"):
        raise ValueError(f"trainer.pack_sequences: got true, expected false for {model_type} "
                         "with sliding-window attention layers")

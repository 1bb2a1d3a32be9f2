"""Writing named tensors into a live HF transformers model, by in-memory or checkpoint name.

transformers 5 holds MoE experts fused (`mlp.experts.gate_up_proj`, shape (E, 2I, H)) while
checkpoints and the weight sync use per-expert names (`mlp.experts.3.gate_proj.weight`; see
`rl.models.name_maps`). Each checkpoint name is resolved once to a strided view of the in-memory
tensor it lives in: the checkpoint conversion is a pure re-indexing (chunk / unbind / rename), so
running it on an `arange` tensor tells exactly which elements every checkpoint tensor occupies.
Conversions that are not strided fall back to a flat index (int64, 8 bytes per element).
"""
from __future__ import annotations

from typing import Iterable

import torch

from rl.models.name_maps import to_engine_weights


class UnknownWeightError(KeyError):
    """A name that is neither an in-memory nor a checkpoint name of the model."""


def _as_strided_of(piece_idx: torch.Tensor) -> tuple[tuple[int, ...], int] | None:
    """Strides and offset that reproduce `piece_idx` as a view of a flat arange, or None."""
    flat = piece_idx.reshape(-1)
    if flat.numel() == 0:
        return None
    offset = int(flat[0])
    strides = []
    for d, size in enumerate(piece_idx.shape):
        if size > 1:
            index = [0] * piece_idx.dim()
            index[d] = 1
            strides.append(int(piece_idx[tuple(index)]) - offset)
        else:
            strides.append(1)
    if min(strides, default=0) < 0:
        return None
    end = offset + 1 + sum((size - 1) * st for size, st in zip(piece_idx.shape, strides))
    candidate = torch.as_strided(torch.arange(end, dtype=torch.int64), piece_idx.shape, strides,
                                 offset)
    if not torch.equal(candidate, piece_idx):
        return None
    return tuple(strides), offset


class HFWeightTargets:
    """Destination tensors of a model for in-memory names and (lazily mapped) checkpoint names."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.state = dict(model.state_dict(keep_vars=True))
        self._ckpt: dict[str, tuple[str, bool, torch.Tensor]] | None = None

    def _build_checkpoint_map(self) -> dict[str, tuple[str, bool, torch.Tensor]]:
        """checkpoint name -> (state name, is_view, strided view of the state tensor or flat
        int64 index into it)."""
        out: dict[str, tuple[str, bool, torch.Tensor]] = {}
        for name, t in self.state.items():
            idx = torch.arange(t.numel(), dtype=torch.int64).view(t.shape)
            for ck_name, piece in to_engine_weights(self.model, [(name, idx)]):
                if ck_name == name and piece.shape == t.shape:
                    continue  # same name, same layout: handled by the in-memory path
                strided = _as_strided_of(piece) if t.is_contiguous() else None
                if strided is not None:
                    view = torch.as_strided(t.data, piece.shape, strided[0],
                                            t.data.storage_offset() + strided[1])
                    out[ck_name] = (name, True, view)
                else:
                    out[ck_name] = (name, False, piece.reshape(-1).to(t.device))
        return out

    def copy_(self, name: str, tensor: torch.Tensor) -> None:
        """Copy `tensor` into the model (cast to the target's dtype and device)."""
        target = self.state.get(name)
        if target is not None:
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name}: got shape {tuple(tensor.shape)}, model has "
                                 f"{tuple(target.shape)}")
            target.data.copy_(tensor)
            return
        if self._ckpt is None:
            self._ckpt = self._build_checkpoint_map()
        if name not in self._ckpt:
            sample = ", ".join(sorted(self.state)[:3])
            raise UnknownWeightError(f"weight {name!r} is not a parameter or buffer of this "
                                     f"{type(self.model).__name__} (e.g. {sample}) nor a "
                                     "checkpoint name of one")
        state_name, is_view, dst = self._ckpt[name]
        expected = tuple(dst.shape) if is_view else (dst.numel(),)
        got = tuple(tensor.shape) if is_view else (tensor.numel(),)
        if got != expected:
            raise ValueError(f"weight {name}: got shape {tuple(tensor.shape)}, expected "
                             f"{expected if is_view else dst.numel()} elements")
        if is_view:
            dst.copy_(tensor)
        else:
            flat = self.state[state_name].data.view(-1)
            flat.index_copy_(0, dst, tensor.reshape(-1).to(flat.dtype))

    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy every pair; returns how many tensors were written."""
        count = 0
        with torch.no_grad():
            for name, tensor in named:
                self.copy_(name, tensor)
                count += 1
        return count

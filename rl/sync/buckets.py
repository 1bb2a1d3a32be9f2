"""Packing named tensors into fixed-size flat byte buckets for broadcast.

A `SyncPlan` is computed once on the sender from the names, shapes and dtypes of the weights
and shipped to every receiver through the driver (it is small metadata), so that each side
knows the exact byte layout of every bucket before the first byte travels. Buckets are
byte buffers (uint8) so tensors of different dtypes (fp32 weights, int64 buffers, fp8 +
fp32 scales) share one broadcast.

Invariant: the plan depends only on (name, shape, dtype) in order, so two sides that build a
plan from the same model agree without talking.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

_ALIGN = 16  # bytes; keeps every tensor view aligned for its dtype


@dataclass(frozen=True, slots=True)
class TensorSlot:
    name: str
    shape: tuple[int, ...]
    dtype: str
    """torch dtype name without the `torch.` prefix (e.g. `float32`)."""
    offset: int
    """Byte offset inside its bucket."""
    nbytes: int


@dataclass(slots=True)
class Bucket:
    slots: list[TensorSlot] = field(default_factory=list)
    nbytes: int = 0


@dataclass(slots=True)
class SyncPlan:
    buckets: list[Bucket]
    total_bytes: int

    @property
    def num_tensors(self) -> int:
        return sum(len(b.slots) for b in self.buckets)


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in sync plan")
    return dtype


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for d in shape:
        numel *= int(d)
    return numel * torch.empty((), dtype=dtype).element_size()


def make_plan(specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int) -> SyncPlan:
    """Greedy packing in the given order; a tensor larger than a bucket gets a bucket of its own.

    An FP8 wire pair (`x` followed by `x_scale_inv`) always shares a bucket, so each bucket can
    be packed and loaded on its own (no half pair waits for the next bucket).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    specs = list(specs)
    buckets: list[Bucket] = []
    current = Bucket()
    total = 0
    for j, (name, shape, dtype) in enumerate(specs):
        nbytes = _nbytes(shape, dtype)
        offset = -(-current.nbytes // _ALIGN) * _ALIGN
        need = nbytes
        if j + 1 < len(specs) and specs[j + 1][0] == name + "_scale_inv":
            need = -(-nbytes // _ALIGN) * _ALIGN + _nbytes(specs[j + 1][1], specs[j + 1][2])
        if current.slots and offset + need > bucket_bytes and not (
                name.endswith("_scale_inv") and current.slots[-1].name + "_scale_inv" == name):
            buckets.append(current)
            current, offset = Bucket(), 0
        current.slots.append(TensorSlot(name, tuple(int(d) for d in shape),
                                        str(dtype).removeprefix("torch."), offset, nbytes))
        current.nbytes = offset + nbytes
        total += nbytes
    if current.slots:
        buckets.append(current)
    return SyncPlan(buckets=buckets, total_bytes=total)


def plan_for(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> SyncPlan:
    return make_plan(((n, tuple(t.shape), t.dtype) for n, t in named), bucket_bytes)


def pack_bucket(bucket: Bucket, tensors: dict[str, torch.Tensor], device: torch.device | str = "cpu"
                ) -> torch.Tensor:
    """Copy the bucket's tensors into one flat uint8 buffer laid out as the plan says."""
    buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    for slot in bucket.slots:
        t = tensors[slot.name]
        if tuple(t.shape) != slot.shape or str(t.dtype).removeprefix("torch.") != slot.dtype:
            raise ValueError(f"sync plan mismatch for {slot.name}: plan {slot.shape} {slot.dtype}, "
                             f"tensor {tuple(t.shape)} {t.dtype}")
        view = buf[slot.offset: slot.offset + slot.nbytes]
        view.copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return buf


def unpack_bucket(bucket: Bucket, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views into `buf` (no copy); callers that keep them must not reuse `buf`."""
    out = []
    for slot in bucket.slots:
        raw = buf[slot.offset: slot.offset + slot.nbytes]
        out.append((slot.name, raw.view(dtype_of(slot.dtype)).view(slot.shape)))
    return out

"""A dedicated process group joining trainer rank 0 (rank 0 here) and every rollout worker.

It never touches the trainers' default group: it is built from its own `TCPStore`, so DeepSpeed's
collectives and the weight broadcast cannot deadlock on each other. gloo on CPU, NCCL on GPU (which
is RDMA on InfiniBand when NCCL finds the HCAs).

Wire protocol for one update, all broadcasts from rank 0:
  1. header: int64 [version, num_buckets, total_bytes]
  2. per bucket: the uint8 bucket bytes, then (if verify) its 20-byte sha1 digest
Receivers check the header against the plan they were given, so a version or layout mismatch
fails loudly before any weight is loaded.
"""
from __future__ import annotations

import datetime
import hashlib
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from rl.sync.buckets import Bucket, SyncPlan, unpack_bucket


class SyncError(RuntimeError):
    """Weight sync failed (timeout, checksum or layout mismatch); the message says which."""


@dataclass(slots=True)
class WeightGroup:
    pg: dist.ProcessGroup
    rank: int
    world_size: int
    device: torch.device
    timeout_s: float


def resolve_backend(backend: str, device: str | torch.device) -> str:
    """`sync.backend` for a group on `device`: `auto` is NCCL on GPUs, gloo on CPUs."""
    if backend != "auto":
        return backend
    return "gloo" if torch.device(device).type == "cpu" else "nccl"


def make_group(host: str, port: int, world_size: int, rank: int, backend: str = "gloo",
               timeout_s: float = 300.0, device: str | torch.device = "cpu") -> WeightGroup:
    """Rendezvous through a TCPStore hosted by rank 0; raises SyncError on timeout."""
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout,
                              wait_for_workers=True)
    except Exception as e:  # noqa: BLE001 - the store reports timeouts as several error types
        raise SyncError(f"weight-sync rendezvous at {host}:{port} failed for rank {rank}/"
                        f"{world_size} within {timeout_s:.0f}s: {e}") from e
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    else:
        raise ValueError(f"unknown sync backend {backend!r}; expected gloo or nccl")
    return WeightGroup(pg, rank, world_size, torch.device(device), timeout_s)


def _broadcast(group: WeightGroup, t: torch.Tensor, what: str):
    try:
        return group.pg.broadcast([t], dist.BroadcastOptions())
    except Exception as e:  # noqa: BLE001
        raise SyncError(f"weight sync broadcast of {what} failed: {e}") from e


def _wait(work, group: WeightGroup, what: str) -> None:
    try:
        work.wait(datetime.timedelta(seconds=group.timeout_s))
    except Exception as e:  # noqa: BLE001
        raise SyncError(f"weight sync timed out or failed after {group.timeout_s:.0f}s while "
                        f"transferring {what}: {e}") from e


def _digest(buf: torch.Tensor) -> torch.Tensor:
    d = hashlib.sha1(buf.detach().cpu().numpy().tobytes()).digest()
    return torch.frombuffer(bytearray(d), dtype=torch.uint8)


def send_buckets(group: WeightGroup, plan: SyncPlan, version: int,
                 pack: Callable[[int, Bucket], torch.Tensor], verify: bool = False) -> dict:
    """Rank 0: broadcast every bucket. `pack(i, bucket)` returns bucket i's bytes on group.device.

    Pipelined: bucket k+1 is packed while bucket k is in flight.
    """
    t0 = time.perf_counter()
    header = torch.tensor([version, len(plan.buckets), plan.total_bytes], dtype=torch.int64,
                          device=group.device)
    _wait(_broadcast(group, header, "header"), group, "header")
    pending = None
    for i, bucket in enumerate(plan.buckets):
        buf = pack(i, bucket)
        if pending is not None:
            _wait(pending[0], group, f"bucket {i - 1}")
        work = _broadcast(group, buf, f"bucket {i}")
        if verify:
            _wait(work, group, f"bucket {i}")
            digest = _digest(buf).to(group.device)
            work = _broadcast(group, digest, f"checksum {i}")
        pending = (work, buf)
    if pending is not None:
        _wait(pending[0], group, f"bucket {len(plan.buckets) - 1}")
    if group.device.type == "cuda":
        torch.cuda.synchronize(group.device)
    seconds = time.perf_counter() - t0
    return {"bytes": plan.total_bytes, "seconds": seconds,
            "gbytes_per_s": plan.total_bytes / max(seconds, 1e-9) / 1e9}


def receive_buckets(group: WeightGroup, plan: SyncPlan, version: int | None = None,
                    verify: bool = False, raw: bool = False) -> Iterator:
    """Rollout side: yields each bucket's (name, tensor) views as it arrives (`raw`: the bucket's
    uint8 buffer instead). Every bucket gets a fresh buffer that lives as long as its views."""
    header = torch.zeros(3, dtype=torch.int64, device=group.device)
    _wait(_broadcast(group, header, "header"), group, "header")
    got_version, num_buckets, total = (int(x) for x in header.tolist())
    if num_buckets != len(plan.buckets) or total != plan.total_bytes:
        raise SyncError(f"weight sync layout mismatch: sender has {num_buckets} buckets / {total} "
                        f"bytes, receiver plan {len(plan.buckets)} / {plan.total_bytes}")
    if version is not None and got_version != version:
        raise SyncError(f"weight sync version mismatch: sender sent {got_version}, expected {version}")
    def alloc(i: int) -> torch.Tensor:
        return torch.empty(plan.buckets[i].nbytes, dtype=torch.uint8, device=group.device)

    if verify:
        for i, bucket in enumerate(plan.buckets):
            buf = alloc(i)
            _wait(_broadcast(group, buf, f"bucket {i}"), group, f"bucket {i}")
            digest = torch.zeros(20, dtype=torch.uint8, device=group.device)
            _wait(_broadcast(group, digest, f"checksum {i}"), group, f"checksum {i}")
            if not torch.equal(digest.cpu(), _digest(buf)):
                raise SyncError(f"weight sync checksum mismatch in bucket {i} "
                                f"(first tensor {bucket.slots[0].name}, {bucket.nbytes} bytes)")
            yield buf if raw else unpack_bucket(bucket, buf)
        return

    def post(i: int):
        buf = alloc(i)
        return _broadcast(group, buf, f"bucket {i}"), buf

    # One bucket ahead: bucket i+1 is posted before bucket i is handed to the loader, so on NCCL
    # the next transfer is not queued behind the loader's copies (the collective's stream would
    # otherwise wait for everything enqueued on the current stream before it).
    ahead = post(0) if plan.buckets else None
    for i, bucket in enumerate(plan.buckets):
        work, buf = ahead
        ahead = post(i + 1) if i + 1 < len(plan.buckets) else None
        _wait(work, group, f"bucket {i}")
        yield buf if raw else unpack_bucket(bucket, buf)


def join_group(old: WeightGroup | None, host: str, port: int, world_size: int, rank: int,
               backend: str, timeout_s: float, device: torch.device) -> WeightGroup:
    """A receiver's (re)join of the weight group: the old group is torn down first; NCCL groups
    live on the receiver's `device`, gloo groups on the CPU. One place for every engine (hf,
    native, and each vLLM worker)."""
    destroy(old)
    on = device if backend == "nccl" else torch.device("cpu")
    return make_group(host, port, world_size, rank, backend, timeout_s, device=on)


def destroy(group: WeightGroup | None) -> None:
    if group is not None:
        try:
            group.pg.shutdown() if hasattr(group.pg, "shutdown") else None
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass

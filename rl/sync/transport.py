"""The weight-sync transports: how trainer rank 0 (rank 0 here) hands every bucket to every
rollout worker. One class per transport, one small interface (`Transport`); `make_group` picks
the class for `sync.backend` (`rl.sync.backend.choose_backend` decides which one a placement
allows):

- `WeightGroup` (`gloo`, `nccl`): a dedicated process group. It never touches the trainers'
  default group: it is built from its own `TCPStore`, so DeepSpeed's collectives and the weight
  broadcast cannot deadlock on each other. gloo on CPU, NCCL on GPU (which is RDMA on InfiniBand
  when NCCL finds the HCAs).
- `rl.sync.ipc.IpcGroup` (`ipc`): trainer and engines on one device of one host (one GPU holding
  both groups, where NCCL refuses two ranks): buckets pass through shared memory, CUDA IPC on a
  GPU, /dev/shm on a CPU; the handshake and the per-bucket signals go over the same kind of store.

Wire protocol of `WeightGroup` for one update, all broadcasts from rank 0:
  1. header: int64 [version, num_buckets, total_bytes]
  2. per bucket: the uint8 bucket bytes, then (if verify) its 20-byte sha1 digest
Receivers of every transport check the header against the plan they were given, so a version or
layout mismatch fails loudly before any weight is loaded.
"""
from __future__ import annotations

import datetime
import hashlib
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import torch
import torch.distributed as dist

from rl.sync.buckets import Bucket, SyncPlan, unpack_bucket


class SyncError(RuntimeError):
    """Weight sync failed (timeout, checksum or layout mismatch); the message says which."""


Pack = Callable[[int, Bucket], torch.Tensor]
"""`pack(i, bucket)`: bucket i's uint8 bytes on the group's device."""


class Transport(Protocol):
    """What the trainer's sender and every engine's receiver call; one class per backend."""

    rank: int
    world_size: int
    device: torch.device
    """Where buckets live on this side (packed there by the sender, handed out there)."""

    def send(self, plan: SyncPlan, version: int, pack: Pack, verify: bool = False) -> dict:
        """Rank 0: every bucket to every receiver; stats: bytes, seconds, gbytes_per_s."""
        ...

    def receive(self, plan: SyncPlan, version: int | None = None, verify: bool = False,
                raw: bool = False) -> Iterator:
        """Receivers: each bucket's (name, tensor) views as it arrives (`raw`: its uint8 buffer).
        Every bucket is a fresh buffer that lives as long as its views."""
        ...

    def close(self) -> None:
        ...


def resolve_backend(backend: str, device: str | torch.device) -> str:
    """`sync.backend` for a group on `device` when nothing is known of the other side: `auto` is
    NCCL on GPUs, gloo on CPUs. The runtime decides with both sides' devices instead
    (`rl.sync.backend.choose_backend`) and passes the answer to both."""
    if backend != "auto":
        return backend
    return "gloo" if torch.device(device).type == "cpu" else "nccl"


def rendezvous(host: str, port: int, world_size: int, rank: int, timeout_s: float
               ) -> dist.TCPStore:
    """The group's own store, hosted by rank 0 and listening on `host` alone (not every
    interface: `rl.cluster.groups.tcp_store`); raises SyncError on timeout."""
    from rl.cluster.groups import tcp_store
    try:
        return tcp_store(host, port, world_size, rank == 0,
                         datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - the store reports timeouts as several error types
        raise SyncError(f"weight-sync rendezvous at {host}:{port} failed for rank {rank}/"
                        f"{world_size} within {timeout_s:.0f}s: {e}") from e


def make_group(host: str, port: int, world_size: int, rank: int, backend: str = "gloo",
               timeout_s: float = 300.0, device: str | torch.device = "cpu") -> Transport:
    """Rendezvous through a TCPStore hosted by rank 0; raises SyncError on timeout."""
    if backend == "ipc":
        from rl.sync.ipc import IpcGroup
        return IpcGroup.connect(host, port, world_size, rank, timeout_s, torch.device(device))
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown sync backend {backend!r}; expected gloo, nccl or ipc")
    store = rendezvous(host, port, world_size, rank, timeout_s)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    return WeightGroup(pg, rank, world_size, torch.device(device), timeout_s)


def digest(buf: torch.Tensor) -> torch.Tensor:
    """sha1 of a bucket's bytes, as 20 uint8 on the CPU."""
    d = hashlib.sha1(buf.detach().cpu().numpy().tobytes()).digest()
    return torch.frombuffer(bytearray(d), dtype=torch.uint8)


def check_header(plan: SyncPlan, version: int | None, got_version: int, num_buckets: int,
                 total: int) -> None:
    """SyncError unless the sender's header matches the receiver's plan (and version)."""
    if num_buckets != len(plan.buckets) or total != plan.total_bytes:
        raise SyncError(f"weight sync layout mismatch: sender has {num_buckets} buckets / {total} "
                        f"bytes, receiver plan {len(plan.buckets)} / {plan.total_bytes}")
    if version is not None and got_version != version:
        raise SyncError(f"weight sync version mismatch: sender sent {got_version}, expected {version}")


def send_stats(plan: SyncPlan, t0: float) -> dict:
    seconds = time.perf_counter() - t0
    return {"bytes": plan.total_bytes, "seconds": seconds,
            "gbytes_per_s": plan.total_bytes / max(seconds, 1e-9) / 1e9}


@dataclass(slots=True)
class WeightGroup:
    """`gloo` / `nccl`: a dedicated process group; every bucket is a broadcast from rank 0."""
    pg: dist.ProcessGroup
    rank: int
    world_size: int
    device: torch.device
    timeout_s: float

    def _broadcast(self, t: torch.Tensor, what: str):
        try:
            return self.pg.broadcast([t], dist.BroadcastOptions())
        except Exception as e:  # noqa: BLE001
            raise SyncError(f"weight sync broadcast of {what} failed: {e}") from e

    def _wait(self, work, what: str) -> None:
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:  # noqa: BLE001
            raise SyncError(f"weight sync timed out or failed after {self.timeout_s:.0f}s while "
                            f"transferring {what}: {e}") from e

    def send(self, plan: SyncPlan, version: int, pack: Pack, verify: bool = False) -> dict:
        """Pipelined: bucket k+1 is packed while bucket k is in flight."""
        t0 = time.perf_counter()
        header = torch.tensor([version, len(plan.buckets), plan.total_bytes], dtype=torch.int64,
                              device=self.device)
        self._wait(self._broadcast(header, "header"), "header")
        pending = None
        for i, bucket in enumerate(plan.buckets):
            buf = pack(i, bucket)
            if pending is not None:
                self._wait(pending[0], f"bucket {i - 1}")
            work = self._broadcast(buf, f"bucket {i}")
            if verify:
                self._wait(work, f"bucket {i}")
                work = self._broadcast(digest(buf).to(self.device), f"checksum {i}")
            pending = (work, buf)
        if pending is not None:
            self._wait(pending[0], f"bucket {len(plan.buckets) - 1}")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return send_stats(plan, t0)

    def receive(self, plan: SyncPlan, version: int | None = None, verify: bool = False,
                raw: bool = False) -> Iterator:
        header = torch.zeros(3, dtype=torch.int64, device=self.device)
        self._wait(self._broadcast(header, "header"), "header")
        check_header(plan, version, *(int(x) for x in header.tolist()))

        def alloc(i: int) -> torch.Tensor:
            return torch.empty(plan.buckets[i].nbytes, dtype=torch.uint8, device=self.device)

        if verify:
            for i, bucket in enumerate(plan.buckets):
                buf = alloc(i)
                self._wait(self._broadcast(buf, f"bucket {i}"), f"bucket {i}")
                sha = torch.zeros(20, dtype=torch.uint8, device=self.device)
                self._wait(self._broadcast(sha, f"checksum {i}"), f"checksum {i}")
                if not torch.equal(sha.cpu(), digest(buf)):
                    raise SyncError(f"weight sync checksum mismatch in bucket {i} "
                                    f"(first tensor {bucket.slots[0].name}, {bucket.nbytes} bytes)")
                yield buf if raw else unpack_bucket(bucket, buf)
            return

        def post(i: int):
            buf = alloc(i)
            return self._broadcast(buf, f"bucket {i}"), buf

        # One bucket ahead: bucket i+1 is posted before bucket i is handed to the loader, so on
        # NCCL the next transfer is not queued behind the loader's copies (the collective's
        # stream would otherwise wait for everything enqueued on the current stream before it).
        ahead = post(0) if plan.buckets else None
        for i, bucket in enumerate(plan.buckets):
            work, buf = ahead  # type: ignore[misc]  # lint baseline (issue 39)
            ahead = post(i + 1) if i + 1 < len(plan.buckets) else None
            self._wait(work, f"bucket {i}")
            yield buf if raw else unpack_bucket(bucket, buf)

    def close(self) -> None:
        try:
            self.pg.shutdown() if hasattr(self.pg, "shutdown") else None
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass


def send_buckets(group: Transport, plan: SyncPlan, version: int, pack: Pack,
                 verify: bool = False) -> dict:
    """Rank 0: send every bucket (`Transport.send`). `pack(i, bucket)` returns bucket i's bytes
    on group.device."""
    return group.send(plan, version, pack, verify)


def receive_buckets(group: Transport, plan: SyncPlan, version: int | None = None,
                    verify: bool = False, raw: bool = False) -> Iterator:
    """Rollout side: yields each bucket's (name, tensor) views as it arrives (`raw`: the bucket's
    uint8 buffer instead). Every bucket gets a fresh buffer that lives as long as its views."""
    return group.receive(plan, version, verify, raw)


def join_group(old: Transport | None, host: str, port: int, world_size: int, rank: int,
               backend: str, timeout_s: float, device: torch.device) -> Transport:
    """A receiver's (re)join of the weight group: the old group is torn down first; NCCL and IPC
    groups live on the receiver's `device`, gloo groups on the CPU. One place for every engine
    (hf, native, and each vLLM worker)."""
    destroy(old)
    on = device if backend in ("nccl", "ipc") else torch.device("cpu")
    return make_group(host, port, world_size, rank, backend, timeout_s, device=on)


def destroy(group: Transport | None) -> None:
    if group is not None:
        group.close()

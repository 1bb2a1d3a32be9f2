"""`sync.backend: ipc`: the weight sync between processes that share one device of one host.

One GPU holding both the trainer and the rollout engine is how most first runs look, and NCCL
refuses it (two ranks of one group on one GPU: "Duplicate GPU detected"). Here buckets pass
through memory both sides map instead of a process group: rank 0 (trainer rank 0) owns two
staging slots, each as large as the largest bucket, which every receiver maps once - a CUDA
allocation shared by CUDA IPC handles (`torch.multiprocessing.reductions`, what verl, slime and
OpenRLHF use to hand a colocated vLLM its buckets) on a GPU, a file in /dev/shm on a CPU. The two
differ only in `_share` / `_open`; the protocol is one code path, which is what lets the CPU tests
run the GPU's.

The handshake and the signals go over a TCPStore hosted by rank 0 (the runtime puts it on
loopback: every peer is on this host); its values are unpickled through an allowlist
(`_StoreValues`), so a process that connects to it cannot make a peer run code. Update `r`'s
keys start with `r{r}/`, a constant number of them per update (deleted after it):
  connect  rank 0 publishes its host, device and pid; each receiver checks that it is on the same
           host and device (else SyncError naming both) and answers with its pid.
  header   (version, num_buckets, total_bytes, verify, staging id, staging handles)
  sent     counter: rank 0 waits until every receiver copied bucket i - 2 (slot i % 2 is free),
           packs bucket i into slot i % 2 (its sha1 after it when verifying), adds 1.
  acked/k  counter: receiver k adds 1 once it read the header (and mapped new slots), then per
           bucket copies the slot into a fresh buffer, checks the sha1, adds 1, yields the buffer.
           Rank 0 returns when every receiver has acked every bucket.
  abort    either side that fails mid-update writes its reason; the others raise SyncError.
A receiver holds one bucket of its own at a time (released with its views), rank 0 the two slots:
no whole-model copy anywhere. Every waiting side also watches its peers' processes (one host by
construction): one that dies mid-update is a SyncError at once, not after `sync.timeout_s`.
"""
from __future__ import annotations

import io
import os
import pickle
import socket
import tempfile
import time
import uuid
from pathlib import Path
from typing import Iterator

import torch

from rl.sync.buckets import SyncPlan, unpack_bucket
from rl.sync.transport import Pack, SyncError, check_header, digest, rendezvous, send_stats

_POLL_MAX_S = 0.002
"""Longest sleep between two looks at the store (it has no wake-up without a blocking wait,
whose timeouts the store logs as warnings); the first looks come after microseconds."""
_LIVENESS_EVERY_S = 0.05
"""How often a waiting side checks the abort key and its peers' processes."""
_SHA = 20
"""Bytes of a sha1, kept in the slot after its bucket (`sync.verify`)."""


def host_id() -> str:
    """This machine (hostname and boot id): shared memory only reaches processes of one host."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def device_id(device: torch.device) -> str:
    """`cpu`, or the GPU's UUID (the same GPU has different indices under different
    CUDA_VISIBLE_DEVICES)."""
    if device.type == "cpu":
        return "cpu"
    return f"{device.type}:{torch.cuda.get_device_properties(device).uuid}"


def alive(pid: int) -> bool:
    """Whether process `pid` (on this host) still runs; a zombie counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


class _StoreValues(pickle.Unpickler):
    """Unpickles what this protocol puts in the store (dicts, tuples, numbers, strings, bytes
    and a CUDA IPC handle's torch.Tensor / Size / storage classes and dtype) and nothing else:
    a process that connected to the store cannot make a peer run code by writing a key."""
    _ALLOWED = {("torch", "Tensor"), ("torch", "Size"), ("torch.storage", "TypedStorage"),
                ("torch.storage", "UntypedStorage")}

    def find_class(self, module: str, name: str):
        if (module, name) in self._ALLOWED or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of the weight-sync protocol")


def _loads(data: bytes):
    try:
        return _StoreValues(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as e:
        raise SyncError(f"weight sync over ipc: a value in the store is not the protocol's "
                        f"({e}): another process wrote to the store?") from e


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class IpcGroup:
    """Rank 0 sends, ranks 1.. receive; all on one device of one host (see the module doc)."""

    def __init__(self, store, rank: int, world_size: int, device: torch.device, timeout_s: float,
                 peers: dict[int, int]):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.device, self.timeout_s = device, timeout_s
        self.peers = peers
        """rank -> pid of the processes this side waits on (rank 0: the receivers; else rank 0)."""
        self._round = 0        # updates so far: both sides count them, keys carry the count
        self._staging: list[torch.Tensor] = []   # rank 0: the two slots; receivers: mapped views
        self._staging_id = ""
        self._handles: list = []
        self._files: list[str] = []   # CPU staging files not yet unlinked (rank 0)

    # ---- connect ---------------------------------------------------------------------------
    @classmethod
    def connect(cls, host: str, port: int, world_size: int, rank: int, timeout_s: float,
                device: torch.device) -> IpcGroup:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        store = rendezvous(host, port, world_size, rank, timeout_s)
        here = {"host": host_id(), "device": device_id(device), "pid": os.getpid()}
        group = cls(store, rank, world_size, device, timeout_s, {})
        if rank == 0:
            store.set("where", pickle.dumps(here))
            for k in range(1, world_size):
                answer = group._get(f"joined/{k}", "the handshake")
                if answer["error"]:
                    raise SyncError(answer["error"])
                group.peers[k] = answer["pid"]
            return group
        sender = group._get("where", "the handshake")
        group.peers[0] = sender["pid"]
        error = None
        if sender["host"] != here["host"] or sender["device"] != here["device"]:
            error = (f"weight sync over ipc needs trainer rank 0 and every engine on one device "
                     f"of one host: rank 0 is on {sender['device']} of {sender['host']}, rank "
                     f"{rank} on {here['device']} of {here['host']}; set sync.backend=auto "
                     "(nccl between GPUs, gloo otherwise)")
        store.set(f"joined/{rank}", pickle.dumps({"pid": here["pid"], "error": error}))
        if error:
            raise SyncError(error)
        return group

    # ---- waiting on the store --------------------------------------------------------------
    def _await(self, ready, what: str, round_: int | None = None) -> None:
        """Until `ready()`; SyncError on timeout, on an abort of update `round_`, when a peer's
        process is gone, or when the store is (rank 0 stopped)."""
        t0 = last_look = time.monotonic()
        pause = 1e-5
        while True:
            try:
                if ready():
                    return
            except Exception as e:  # noqa: BLE001 - several error types for a lost connection
                raise SyncError(f"weight sync over ipc lost its store while waiting for {what} "
                                f"(rank 0 stopped?): {e}") from e
            now = time.monotonic()
            if now - last_look >= _LIVENESS_EVERY_S:
                last_look = now
                self._check_peers(what, round_)
                if now - t0 > self.timeout_s:
                    raise SyncError(f"weight sync timed out after {self.timeout_s:.0f}s waiting "
                                    f"for {what} (ipc, rank {self.rank})")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    def _get(self, key: str, what: str, round_: int | None = None):
        """The value of `key` once someone set it."""
        self._await(lambda: self.store.check([key]), what, round_)
        return _loads(self.store.get(key))

    def _await_count(self, key: str, at_least: int, what: str, round_: int) -> None:
        self._await(lambda: self.store.add(key, 0) >= at_least, what, round_)

    def _check_peers(self, what: str, round_: int | None) -> None:
        if round_ is not None and self.store.check([f"r{round_}/abort"]):
            reason = self.store.get(f"r{round_}/abort").decode()
            raise SyncError(f"weight sync aborted while waiting for {what}: {reason}")
        for k, pid in self.peers.items():
            if not alive(pid):
                role = "trainer rank 0 (the sender)" if k == 0 else f"receiver rank {k}"
                raise SyncError(f"weight sync over ipc: {role}, pid {pid}, is gone while this "
                                f"side waits for {what}")

    def _abort(self, round_: int, reason: str) -> None:
        """Tell the others why this side stopped (the first reason stays)."""
        key = f"r{round_}/abort"
        try:
            if not self.store.check([key]):
                self.store.set(key, f"rank {self.rank}: {reason}".encode())
        except Exception:  # noqa: BLE001 - the store may be what failed
            pass

    # ---- staging buffers -------------------------------------------------------------------
    def _share(self, nbytes: int) -> tuple[torch.Tensor, object]:
        """A new staging buffer and what a receiver needs to map it (`_open`)."""
        if self.device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            return buf, reduce_tensor(buf)[1]
        path = os.path.join(_shm_dir(), f"rl-sync-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        self._files.append(path)
        return buf, (path, nbytes)

    def _open(self, handle) -> torch.Tensor:
        if self.device.type == "cuda":
            from torch.multiprocessing.reductions import rebuild_cuda_tensor
            args = list(handle)
            args[6] = self.device.index  # the sender's index may name this GPU differently
            return rebuild_cuda_tensor(*args)
        path, nbytes = handle
        return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)

    def _unlink_files(self) -> None:
        """CPU staging: once every receiver mapped the files their names can go (the memory
        stays until the last mapping does), so only a crash between creating them and the
        receivers' first header ack can leave files behind in /dev/shm."""
        for path in self._files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._files = []

    def _ensure_staging(self, nbytes: int) -> None:
        """Two slots of `nbytes` bucket bytes + a sha1 each (kept while large enough)."""
        if self._staging and self._staging[0].numel() >= nbytes + _SHA:
            return
        self._staging, self._handles = [], []
        self._unlink_files()
        for _ in range(2):
            buf, handle = self._share(nbytes + _SHA)
            self._staging.append(buf)
            self._handles.append(handle)
        self._staging_id = uuid.uuid4().hex

    # ---- one update ------------------------------------------------------------------------
    def send(self, plan: SyncPlan, version: int, pack: Pack, verify: bool = False) -> dict:
        t0 = time.perf_counter()
        r, self._round = self._round, self._round + 1
        n = len(plan.buckets)
        receivers = range(1, self.world_size)
        self._ensure_staging(max((b.nbytes for b in plan.buckets), default=0))
        self.store.set(f"r{r}/header", pickle.dumps(
            (version, n, plan.total_bytes, verify, self._staging_id, self._handles)))

        def copied(i: int) -> None:  # every receiver holds its own copy of bucket i (-1: read
            for k in receivers:      # the header and mapped the slots)
                self._await_count(f"r{r}/acked/{k}", i + 2,
                                  f"receiver rank {k}'s copy of bucket {i}" if i >= 0 else
                                  f"receiver rank {k} to read the header", r)
        try:
            if self._files:  # new CPU slots: their names can go once every receiver mapped them
                copied(-1)
                self._unlink_files()
            for i, bucket in enumerate(plan.buckets):
                if i >= 2:
                    copied(i - 2)  # slot i % 2 held bucket i - 2
                buf = pack(i, bucket)
                slot = self._staging[i % 2]
                if buf.data_ptr() != slot.data_ptr():
                    slot[:bucket.nbytes].copy_(buf.reshape(-1))
                if verify:
                    slot[bucket.nbytes:bucket.nbytes + _SHA].copy_(
                        digest(slot[:bucket.nbytes]).to(self.device))
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # the bytes are there before announced
                self.store.add(f"r{r}/sent", 1)
            for i in range(max(n - 2, -1), n):
                copied(i)
        except BaseException as e:
            self._abort(r, f"the sender failed: {e}")
            self._unlink_files()
            raise
        for key in (f"r{r}/header", f"r{r}/sent", f"r{r}/abort",
                    *(f"r{r}/acked/{k}" for k in receivers)):
            self.store.delete_key(key)  # the store keeps every key it is given
        return send_stats(plan, t0)

    def receive(self, plan: SyncPlan, version: int | None = None, verify: bool = False,
                raw: bool = False) -> Iterator:
        r, self._round = self._round, self._round + 1
        i = -1
        try:
            got, n, total, sender_verifies, staging_id, handles = self._get(
                f"r{r}/header", "the header", r)
            check_header(plan, version, got, n, total)
            if verify != sender_verifies:
                raise SyncError(f"weight sync: sync.verify differs between the sender "
                                f"({sender_verifies}) and this engine ({verify})")
            if staging_id != self._staging_id:
                self._staging = [self._open(h) for h in handles]
                self._staging_id = staging_id
            self.store.add(f"r{r}/acked/{self.rank}", 1)  # header read, slots mapped
            for i, bucket in enumerate(plan.buckets):
                self._await_count(f"r{r}/sent", i + 1, f"bucket {i}", r)
                slot = self._staging[i % 2]
                buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
                buf.copy_(slot[:bucket.nbytes])
                sha = slot[bucket.nbytes:bucket.nbytes + _SHA].cpu() if verify else None
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # copied before the slot is released
                if verify and not torch.equal(sha, digest(buf)):
                    raise SyncError(f"weight sync checksum mismatch in bucket {i} "
                                    f"(first tensor {bucket.slots[0].name}, {bucket.nbytes} bytes)")
                self.store.add(f"r{r}/acked/{self.rank}", 1)
                yield buf if raw else unpack_bucket(bucket, buf)
        except GeneratorExit:  # the caller stopped reading part-way
            if i + 1 < len(plan.buckets):
                self._abort(r, f"receiver stopped reading after bucket {i}")
            raise
        except BaseException as e:
            self._abort(r, str(e))
            raise

    def close(self) -> None:
        self._unlink_files()
        self._staging, self._handles = [], []
        self.store = None

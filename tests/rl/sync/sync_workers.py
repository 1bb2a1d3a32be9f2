"""Minimal sync sender and receiver that the transport tests host as actors (plain processes or
Ray): the real transports (`rl.sync.transport`: gloo, or ipc through shared memory) on a small
fixed set of tensors."""
from __future__ import annotations

import os
import time

import torch

from rl.sync.buckets import pack_bucket, plan_for
from rl.sync.transport import make_group, receive_buckets, send_buckets


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(64, 64, generator=g) for i in range(6)}  # 16 KiB each


def plan():
    return plan_for(tensors().items(), bucket_bytes=16384)  # one tensor per bucket: 6 buckets


class Sender:
    def pid(self) -> int:
        return os.getpid()

    def send(self, port: int, version: int, timeout_s: float, backend: str = "gloo",
             verify: bool = False, rounds: int = 1) -> dict:
        """`rounds` updates over one group (versions version, version + 1, ...); the weights
        change between them. Returns the last update's stats."""
        t = tensors()
        group = make_group("127.0.0.1", port, 2, 0, backend, timeout_s=timeout_s)
        for r in range(rounds):
            stats = send_buckets(group, plan(), version + r,
                                 lambda _i, b: pack_bucket(b, {k: v + r for k, v in t.items()}),
                                 verify=verify)
        return stats


class Receiver:
    def pid(self) -> int:
        return os.getpid()

    def receive(self, port: int, version: int, timeout_s: float, stop_after: int | None = None,
                how: str = "exit", backend: str = "gloo") -> int:
        """Receives until `stop_after` buckets have arrived, then stops taking part: `exit` ends
        the process at once, `hang` stays alive without receiving. Returns the bucket count."""
        group = make_group("127.0.0.1", port, 2, 1, backend, timeout_s=timeout_s)
        count = 0
        for _items in receive_buckets(group, plan(), version):
            count += 1
            if count == stop_after:
                if how == "exit":
                    os._exit(3)
                time.sleep(3600)
        return count

    def receive_all(self, port: int, version: int, timeout_s: float, backend: str,
                    verify: bool = False, rounds: int = 1) -> list[bool]:
        """`rounds` updates; per update whether every tensor arrived bit for bit."""
        group = make_group("127.0.0.1", port, 2, 1, backend, timeout_s=timeout_s)
        ok = []
        for r in range(rounds):
            want = {k: v + r for k, v in tensors().items()}
            got = {n: x.clone() for items in receive_buckets(group, plan(), version + r, verify)
                   for n, x in items}
            ok.append(got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want))
        return ok

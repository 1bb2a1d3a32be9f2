"""Minimal sync sender and receiver that the fault tests host as actors (plain processes or Ray):
the real transport (`rl.sync.transport`) over gloo, on a small fixed set of tensors."""
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

    def send(self, port: int, version: int, timeout_s: float) -> dict:
        t = tensors()
        group = make_group("127.0.0.1", port, 2, 0, "gloo", timeout_s=timeout_s)
        return send_buckets(group, plan(), version, lambda _i, b: pack_bucket(b, t))


class Receiver:
    def pid(self) -> int:
        return os.getpid()

    def receive(self, port: int, version: int, timeout_s: float, stop_after: int | None = None,
                how: str = "exit") -> int:
        """Receives until `stop_after` buckets have arrived, then stops taking part: `exit` ends
        the process at once, `hang` stays alive without receiving. Returns the bucket count."""
        group = make_group("127.0.0.1", port, 2, 1, "gloo", timeout_s=timeout_s)
        count = 0
        for _items in receive_buckets(group, plan(), version):
            count += 1
            if count == stop_after:
                if how == "exit":
                    os._exit(3)
                time.sleep(3600)
        return count

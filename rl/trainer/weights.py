"""Trainer side of the online weight update: gather -> bucket -> broadcast.

Under ZeRO-3 every rank holds a shard, so gathering a bucket's parameters is a collective that
all ranks enter in the same order; only rank 0 packs and broadcasts on the weight group. Buffers
that matter for inference (`tid2eid`, `e_score_correction_bias`, ...) are not parameters and are
sent from rank 0's own copy.
"""
from __future__ import annotations

import contextlib

import torch

from rl.config import SyncConfig
from rl.sync import transport
from rl.sync.buckets import Bucket, SyncPlan, make_plan, pack_bucket


def persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, buf in module.named_buffers():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if leaf not in owner._non_persistent_buffers_set:
            out.append((name, buf))
    return out


class WeightSender:
    def __init__(self, module: torch.nn.Module, zero_stage: int, is_sender: bool, sync: SyncConfig,
                 device: torch.device):
        self.module, self.zero_stage, self.is_sender = module, zero_stage, is_sender
        self.sync, self.device = sync, device
        self.params = dict(module.named_parameters())
        self.buffers = dict(persistent_buffers(module))
        self._plan: SyncPlan | None = None
        self.group: transport.WeightGroup | None = None

    def _specs(self):
        for name, p in self.params.items():
            yield name, tuple(getattr(p, "ds_shape", p.shape)), p.dtype
        for name, b in self.buffers.items():
            yield name, tuple(b.shape), b.dtype

    def plan(self) -> SyncPlan:
        if self._plan is None:
            self._plan = make_plan(self._specs(), int(self.sync.bucket_mb * 2**20))
        return self._plan

    @contextlib.contextmanager
    def _gathered(self, bucket: Bucket):
        params = [self.params[s.name] for s in bucket.slots if s.name in self.params]
        if self.zero_stage == 3 and params:
            import deepspeed
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                yield
        else:
            yield

    def _tensors(self, bucket: Bucket) -> dict[str, torch.Tensor]:
        out = {}
        for s in bucket.slots:
            t = self.params.get(s.name)
            out[s.name] = (t if t is not None else self.buffers[s.name]).detach()
        return out

    def connect(self, host: str, port: int, world_size: int) -> None:
        if self.is_sender:
            backend = self.sync.backend
            if backend == "auto":
                backend = "nccl" if self.device.type == "cuda" else "gloo"
            self.group = transport.make_group(host, port, world_size, 0, backend,
                                              self.sync.timeout_s, self.device)

    def send(self, version: int) -> dict:
        plan = self.plan()
        if not self.is_sender:
            for bucket in plan.buckets:  # take part in the gathers only
                with self._gathered(bucket):
                    pass
            return {}
        if self.group is None:
            raise transport.SyncError("send_weights called before init_weight_sync")

        def pack(i: int, bucket: Bucket) -> torch.Tensor:
            with self._gathered(bucket):
                return pack_bucket(bucket, self._tensors(bucket), self.group.device)

        return transport.send_buckets(self.group, plan, version, pack, verify=self.sync.verify)

    def gather_all(self) -> dict[str, torch.Tensor]:
        out = {}
        for bucket in self.plan().buckets:
            with self._gathered(bucket):
                if self.is_sender:
                    out.update({k: v.detach().cpu().clone() for k, v in self._tensors(bucket).items()})
        return out

    def close(self) -> None:
        transport.destroy(self.group)
        self.group = None

"""Trainer side of the online weight update: gather -> bucket -> broadcast.

Under ZeRO-3 every rank holds a shard, so gathering a bucket's parameters is a collective that
all ranks enter in the same order; only rank 0 packs and broadcasts on the weight group. Buffers
that matter for inference (`tid2eid`, `e_score_correction_bias`, ...) are not parameters and are
sent from rank 0's own copy.

`sync.wire_dtype: fp8` quantises on send: every parameter `rl.quant.should_quantize` picks (2-D
linear weights and 3-D expert stacks not matched by `sync.wire_keep_bf16`) travels as e4m3 bytes
(`name`, uint8) plus fp32 128x128 block scales (`name_scale_inv`), about half of BF16's bytes.
A weight is quantised while its bucket is packed, i.e. while the previous bucket is in flight;
its scale may land in the next bucket (it is held until then). With `native` the rollout engine
quantises on receive instead (BF16 on the wire).
"""
from __future__ import annotations

import contextlib

import torch

from rl.config import SyncConfig
from rl.quant.block_fp8 import DEFAULT_BLOCK, num_blocks
from rl.quant.fast_quant import quantize_weight_fast
from rl.quant.policy import as_policy, should_quantize
from rl.quant.wire import scale_name
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
        self._keep = as_policy(sync.wire_keep_bf16)
        self._scales: dict[str, torch.Tensor] = {}  # quantised, waiting for their bucket

    def _fp8(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        return (self.sync.wire_dtype == "fp8" and name in self.params and dtype.is_floating_point
                and should_quantize(name, shape, self._keep))

    def _specs(self):
        for name, p in self.params.items():
            shape = tuple(getattr(p, "ds_shape", p.shape))
            if self._fp8(name, shape, p.dtype):
                *lead, n, k = shape
                yield name, shape, torch.uint8
                yield scale_name(name), (*lead, num_blocks(n, DEFAULT_BLOCK),
                                         num_blocks(k, DEFAULT_BLOCK)), torch.float32
            else:
                yield name, shape, p.dtype
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
            if t is not None and s.dtype == "uint8" and t.dtype != torch.uint8:
                out[s.name], self._scales[scale_name(s.name)] = quantize_weight_fast(t.detach())
            elif s.name in self._scales:
                out[s.name] = self._scales.pop(s.name)
            else:
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
                if self.is_sender:  # full precision, whatever the wire carries
                    for slot in bucket.slots:
                        t = self.params.get(slot.name, self.buffers.get(slot.name))
                        if t is not None:
                            out[slot.name] = t.detach().cpu().clone()
        return out

    def close(self) -> None:
        transport.destroy(self.group)
        self.group = None

"""Trainer side of the online weight update: gather -> bucket -> broadcast.

The stream's names are `rl.models.name_maps.stream_pieces`: what the rollout engines' loaders
read (DeepSeek-V4: its checkpoint names, experts one by one; others: in-memory names).

Under ZeRO-3 every rank holds a shard, so gathering a bucket's parameters is a collective that
all ranks enter in the same order; only rank 0 packs and broadcasts on the weight group. Buffers
that matter for inference (`tid2eid`, `e_score_correction_bias`, ...) are not parameters and are
sent from rank 0's own copy. Under expert parallelism (`experts`, an
`rl.trainer.expert_parallel.ExpertParallel`) each routed-expert weight is all-gathered from its
EP group's ranks instead, under its HF name, so the stream is the same as without it.

`sync.wire_dtype: fp8` quantises on send: every parameter `rl.quant.should_quantize` picks (2-D
linear weights and 3-D expert stacks not matched by `sync.wire_keep_bf16`) travels as e4m3 bytes
(`name`, uint8) plus fp32 128x128 block scales (`name_scale_inv`), about half of BF16's bytes.
A weight is quantised while its bucket is packed, i.e. while the previous bucket is in flight;
its scale may land in the next bucket (it is held until then). With `native` the rollout engine
quantises on receive instead (BF16 on the wire).
"""
from __future__ import annotations

import contextlib
import warnings

import torch
from transformers import PreTrainedModel

from rl.config import SyncConfig
from rl.models.name_maps import stream_pieces
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
                 device: torch.device, experts=None):
        self.module, self.zero_stage, self.is_sender = module, zero_stage, is_sender
        self.sync, self.device = sync, device
        self.params = dict(module.named_parameters())
        self.buffers = dict(persistent_buffers(module))
        self.experts = experts
        # Sharded expert weights: full shapes as meta tensors; the bucket's gather fills `_full`.
        self._expert_meta = {n: torch.empty(shape, dtype=dtype, device="meta") for n, (shape, dtype)
                             in (experts.full_specs().items() if experts is not None else ())}
        self._full: dict[str, torch.Tensor] = {}
        # The stream carries wire names (`name_maps.stream_pieces`): for DeepSeek-V4 its
        # checkpoint names, one tensor per expert. wire name -> in-memory name it is cut from.
        self._source: dict[str, str] = {}
        self._wire_specs: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        for name, t in [*self.params.items(), *self._expert_meta.items(), *self.buffers.items()]:
            shape = tuple(getattr(t, "ds_shape", t.shape))
            for wire, piece in self._pieces(name, torch.empty(shape, dtype=t.dtype,
                                                              device="meta")):
                self._source[wire] = name
                self._wire_specs.append((wire, tuple(piece.shape), t.dtype))
        self._plan: SyncPlan | None = None
        self.group: transport.Transport | None = None
        self._keep = as_policy(sync.wire_keep_bf16)
        self._scales: dict[str, torch.Tensor] = {}  # quantised, waiting for their bucket
        self._ring: list[torch.Tensor] | None = None   # GPU: two reusable bucket buffers
        self._graphs: list | None = None
        self._sends = 0

    def _pieces(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if isinstance(self.module, PreTrainedModel):
            return stream_pieces(self.module, name, tensor)
        return [(name, tensor)]

    def _fp8(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        src = self._source.get(name)
        return (self.sync.wire_dtype == "fp8" and (src in self.params or src in self._expert_meta)
                and dtype.is_floating_point and should_quantize(name, shape, self._keep))

    def _specs(self):
        for name, shape, dtype in self._wire_specs:
            if self._fp8(name, shape, dtype):
                *lead, n, k = shape
                yield name, shape, torch.uint8
                yield scale_name(name), (*lead, num_blocks(n, DEFAULT_BLOCK),
                                         num_blocks(k, DEFAULT_BLOCK)), torch.float32
            else:
                yield name, shape, dtype

    def plan(self) -> SyncPlan:
        if self._plan is None:
            self._plan = make_plan(self._specs(), int(self.sync.bucket_mb * 2**20))
        return self._plan

    @contextlib.contextmanager
    def _gathered(self, bucket: Bucket):
        sources = dict.fromkeys(self._source[s.name] for s in bucket.slots
                                if s.name in self._source)
        params = [self.params[n] for n in sources if n in self.params]
        # Collective over each EP group (every rank walks the same plan).
        self._full = {n: self.experts.gather(n) for n in sources if n in self._expert_meta}
        try:
            if self.zero_stage == 3 and params:
                import deepspeed
                with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                    yield
            else:
                yield
        finally:
            self._full = {}

    def _tensors(self, bucket: Bucket) -> dict[str, torch.Tensor]:
        """Wire name -> tensor (a view of a gathered parameter or a buffer) of every slot of
        `bucket` that is not a separately travelling FP8 scale."""
        out: dict[str, torch.Tensor] = {}
        wanted = {s.name for s in bucket.slots}
        for src in dict.fromkeys(self._source[n] for n in wanted if n in self._source):
            t = self._full.get(src)
            if t is None:
                t = self.params[src] if src in self.params else self.buffers[src]
            out.update((w, p) for w, p in self._pieces(src, t.detach()) if w in wanted)
        return out

    def _pack(self, bucket: Bucket, buf: torch.Tensor | None = None) -> torch.Tensor:
        """Bucket bytes (into `buf` when given); FP8 weights are quantised straight into it."""
        if self.sync.wire_dtype != "fp8" and buf is None:
            return pack_bucket(bucket, self._tensors(bucket), self.group.device)  # type: ignore[union-attr]  # lint baseline (issue 39)
        if buf is None:
            buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.group.device)  # type: ignore[union-attr]  # lint baseline (issue 39)
        views = {s.name: (buf[s.offset:s.offset + s.nbytes], s) for s in bucket.slots}
        tensors = self._tensors(bucket)
        done = set()
        for s in bucket.slots:
            if s.name in done:
                continue
            dst = views[s.name][0]
            t = tensors.get(s.name)
            if t is not None and s.dtype == "uint8" and t.dtype != torch.uint8:
                sname = scale_name(s.name)
                if sname in views:
                    sdst, sslot = views[sname]
                    sdst = sdst.view(torch.float32).view(sslot.shape)
                    done.add(sname)
                else:  # the scale travels in the next bucket (plans made elsewhere)
                    sdst = None
                _, scale = quantize_weight_fast(t.detach(), out=dst.view(s.shape), scale_out=sdst)
                if sdst is None:
                    self._scales[sname] = scale
            elif s.name in self._scales:
                dst.copy_(self._scales.pop(s.name).reshape(-1).view(torch.uint8))
            else:
                dst.copy_(t.contiguous().reshape(-1).view(torch.uint8))  # type: ignore[union-attr]  # lint baseline (issue 39)
        return buf

    def _graph_packs(self, plan: SyncPlan) -> list | None:
        """One CUDA graph per bucket that packs it into its ring buffer, or None.

        Without ZeRO-3 the parameters never move, so bucket i's pack is the same kernels on the
        same addresses every sync: one replay instead of a Python loop of launches per tensor
        (which otherwise sets the pace for NCCL). Captured at the second send (the first
        compiles the Triton kernels); the ring buffers hold 2 x the largest bucket.
        """
        if (self.device.type != "cuda" or self.zero_stage == 3 or self.experts is not None
                or self._sends < 1):  # sharded experts are gathered anew every sync
            return None
        if self._graphs is None:
            split = any(s.dtype == "uint8" and not any(
                x.name == scale_name(s.name) for x in b.slots) for b in plan.buckets for s in b.slots)
            if split:
                self._graphs = []
                return None
            graphs = []
            try:
                for i, bucket in enumerate(plan.buckets):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, capture_error_mode="thread_local"):
                        self._pack(bucket, self._ring[i % 2][:bucket.nbytes])  # type: ignore[index]  # lint baseline (issue 39)
                    graphs.append(g)
            except RuntimeError as e:  # a speed-up only: say so and pack eagerly
                warnings.warn(f"weight sync: capturing the bucket packs in CUDA graphs failed "
                              f"({e}); packing eagerly", RuntimeWarning, stacklevel=2)
                graphs = []
            self._graphs = graphs
        return self._graphs or None

    def connect(self, host: str, port: int, world_size: int, backend: str | None = None) -> None:
        """Rank 0 joins the weight group as its sender. `backend`: the transport the runtime
        chose with both sides' devices (`rl.sync.backend`); None = `sync.backend` resolved on
        this side's device alone."""
        if self.is_sender:
            backend = backend or transport.resolve_backend(self.sync.backend, self.device)
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

        if self.device.type == "cuda" and self._ring is None:
            biggest = max(b.nbytes for b in plan.buckets)
            self._ring = [torch.empty(biggest, dtype=torch.uint8, device=self.device)
                          for _ in range(2)]
        graphs = self._graph_packs(plan)

        gathered = [0]

        def pack(i: int, bucket: Bucket) -> torch.Tensor:
            if graphs is not None:
                graphs[i].replay()
                return self._ring[i % 2][:bucket.nbytes]  # type: ignore[index]  # lint baseline (issue 39)
            gathered[0] = i + 1
            with self._gathered(bucket):
                # The ring is safe to reuse: send_buckets waits for bucket i-2 before packing i.
                return self._pack(bucket, None if self._ring is None
                                  else self._ring[i % 2][:bucket.nbytes])

        try:
            stats = transport.send_buckets(self.group, plan, version, pack, verify=self.sync.verify)
        except transport.SyncError:
            # A receiver died mid-update. The other ranks are still walking through the buckets'
            # ZeRO-3 gathers (collectives): finish them so no rank is left blocked, then report.
            if graphs is None:
                for bucket in plan.buckets[gathered[0]:]:
                    with self._gathered(bucket):
                        pass
            raise
        self._sends += 1
        return stats

    def gather_all(self) -> dict[str, torch.Tensor]:
        out = {}
        for bucket in self.plan().buckets:
            with self._gathered(bucket):
                if self.is_sender:  # full precision, whatever the wire carries
                    for name, t in self._tensors(bucket).items():
                        out[name] = t.cpu().clone()
        return out

    def close(self) -> None:
        transport.destroy(self.group)
        self.group = None

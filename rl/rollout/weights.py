"""An engine's end of the weight sync, and turning its stream into the (name, tensor) pairs an
engine loads.

`WeightReceiver` is the one implementation of `init_weight_sync` / `receive_weights`
(`rl.rollout.base.RolloutEngine`): the hf and native engines and each vLLM worker
(`rl.rollout.vllm_ext`) inherit it and only load what arrives. The hf engine and the vLLM workers
receive buckets through `rl.sync.transport.receive_buckets` and feed one flat stream of named
tensors to their loader (`receive_stream`), so a bucket is released as soon as its tensors are
copied (memory stays at about one bucket plus what the loader holds back until a layer is
complete).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator

import torch

from rl.quant.block_fp8 import DEFAULT_BLOCK
from rl.quant.wire import scale_name, unpack_fp8_from_wire, wire_to_fp8
from rl.rollout.base import check_version

if TYPE_CHECKING:
    from rl.sync.buckets import SyncPlan
    from rl.sync.transport import Transport

_SCALE_SUFFIX = scale_name("")  # "_scale_inv"


@dataclass(slots=True)
class StreamStats:
    bytes: int = 0
    num_tensors: int = 0
    t0: float = 0.0

    def as_dict(self) -> dict:
        seconds = time.perf_counter() - self.t0
        return {"bytes": self.bytes, "num_tensors": self.num_tensors, "seconds": seconds,
                "gbytes_per_s": self.bytes / max(seconds, 1e-9) / 1e9}


def pair_wire(named: Iterable[tuple[str, torch.Tensor]]
              ) -> Iterator[tuple[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]]:
    """Join FP8-on-the-wire halves (`x` as uint8 bytes + `x_scale_inv`) into `(x, (bytes, scales))`.

    Everything else passes through unchanged, in order; a pair is yielded when its second half
    arrives (the halves may sit in different buckets). A `_scale_inv` whose weight is not uint8
    (a real FP8 checkpoint tensor) passes through at the end. Raises ValueError for uint8
    weights whose scale never arrives.
    """
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, t in named:
        if name.endswith(_SCALE_SUFFIX):
            base = name[: -len(_SCALE_SUFFIX)]
            if base in weights:
                yield base, (weights.pop(base), t)
            else:
                scales[base] = t
        elif t.dtype == torch.uint8:
            if name in scales:
                yield name, (t, scales.pop(name))
            else:
                weights[name] = t
        else:
            yield name, t
    if weights:
        raise ValueError(f"FP8 wire weights arrived without their scales: {sorted(weights)[:5]}")
    for base, t in scales.items():
        yield base + _SCALE_SUFFIX, t


def decode_wire(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """`pair_wire`, with every FP8 pair dequantised into `dtype` (see `rl.quant.wire`)."""
    for name, value in pair_wire(named):
        if isinstance(value, tuple):
            yield name, unpack_fp8_from_wire(value[0], value[1], dtype=dtype)
        else:
            yield name, value


def receive_stream(group, plan, version: int, verify: bool, dtype: torch.dtype | None,
                   stats: StreamStats | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Named tensors of every bucket of `plan`, decoded into `dtype` (None: FP8 pairs are kept as
    `(bytes, scales)` tuples, see `pair_wire`); counts bytes into `stats` as it goes."""
    from rl.sync.transport import receive_buckets

    stats = stats if stats is not None else StreamStats()
    stats.t0 = time.perf_counter()

    def raw() -> Iterator[tuple[str, torch.Tensor]]:
        for i, bucket in enumerate(receive_buckets(group, plan, version=version, verify=verify)):
            stats.bytes += plan.buckets[i].nbytes
            stats.num_tensors += len(bucket)
            yield from bucket

    return pair_wire(raw()) if dtype is None else decode_wire(raw(), dtype)


class WeightReceiver:
    """An engine's end of the weight-sync group (`rl.sync.transport`): joins it, receives every
    bucket of an update, checks and sets the version, reports stats. A subclass sets `device`
    (where NCCL and IPC buckets land) and `weight_version`, and loads what arrives in
    `_load_received`."""
    device: torch.device
    weight_version: int = 0
    """The version the weights hold (a vLLM worker keeps its own; its engine checks too)."""
    _sync_group: Transport | None = None
    """The weight-sync transport while joined, else None."""

    def init_weight_sync(self, host: str, port: int, world_size: int, rank: int, backend: str,
                         timeout_s: float) -> None:
        """Join (or rejoin) the group as `rank`; blocks until every rank joined."""
        from rl.sync.transport import join_group

        self._sync_group = join_group(self._sync_group, host, port, world_size, rank, backend,
                                      timeout_s, self.device)

    def receive_weights(self, plan: SyncPlan, version: int, verify: bool = False) -> dict:
        """Receive and load every bucket of `plan` as `version`. Stats: bytes, num_tensors,
        seconds (receiving and loading, until the weights are usable), gbytes_per_s,
        loaded_tensors, weight_version."""
        if self._sync_group is None:
            raise RuntimeError("receive_weights before init_weight_sync")
        check_version(self.weight_version, version)
        t0 = time.perf_counter()
        count = self._load_received(self._sync_group, plan, version, verify)
        self.weight_version = version
        seconds = time.perf_counter() - t0
        return {"bytes": plan.total_bytes, "num_tensors": plan.num_tensors, "seconds": seconds,
                "gbytes_per_s": plan.total_bytes / max(seconds, 1e-9) / 1e9,
                "loaded_tensors": count, "weight_version": version}

    def _load_received(self, group: Transport, plan: SyncPlan, version: int, verify: bool
                       ) -> int:
        """Receive every bucket of `plan` from `group` and load it; returns the tensors loaded
        (an FP8 pair counts once)."""
        raise NotImplementedError

    def close_weight_sync(self) -> None:
        """Leave the group (nothing to do when not joined)."""
        from rl.sync.transport import destroy

        destroy(self._sync_group)
        self._sync_group = None


def mxfp4_experts(model_type: str | None, expert_dtype: str | None) -> bool:
    """A DeepSeek-V4 checkpoint whose routed experts are MXFP4 (`expert_dtype` fp4, also vLLM's
    V4 default when the config does not say): the weight sync cannot load such an engine."""
    return model_type == "deepseek_v4" and (expert_dtype or "fp4") == "fp4"


def engine_loads_block_fp8(vllm_config) -> bool:
    """True when a vLLM engine was built from a block-FP8 checkpoint (weights e4m3 with fp32
    128x128 `weight_scale_inv`, what `rl.quant.wire` sends), so the wire's bytes load as they are.

    Raises ValueError for a DeepSeek-V4 engine with MXFP4 experts (`expert_dtype: fp4`, the
    published Flash checkpoint): the wire carries FP8 experts, which that engine cannot take.
    """
    quant = getattr(vllm_config, "quant_config", None)
    if quant is None or not getattr(quant, "is_checkpoint_fp8_serialized", False):
        return False
    if getattr(quant, "weight_block_size", None) != [DEFAULT_BLOCK, DEFAULT_BLOCK]:
        return False
    hf_config = vllm_config.model_config.hf_config
    if mxfp4_experts(getattr(hf_config, "model_type", None),
                     getattr(hf_config, "expert_dtype", None)):
        raise ValueError("weight sync: this DeepSeek-V4 engine holds MXFP4 experts "
                         "(expert_dtype fp4); the wire carries block-FP8 experts: build the "
                         "rollout checkpoint with `python -m launch.convert SRC --rollout-out "
                         "DIR --rollout-experts fp8`")
    return True


def as_fp8_checkpoint(named: Iterable[tuple[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """`pair_wire` output -> block-FP8 checkpoint tensors: `x` as float8_e4m3fn and
    `x_scale_inv` as fp32 (the names and dtypes vLLM's Fp8 / DeepseekV4FP8 loaders read)."""
    for name, value in named:
        if isinstance(value, tuple):
            yield name, wire_to_fp8(value[0])
            yield scale_name(name), value[1]
        else:
            yield name, value

"""Routing replay in the HF MoE gates: record which experts a forward chose, or make it choose
given ones (`algorithm.routing_replay`).

Layout of a routing array (one per sample, `rl.rollout.routing`): (tokens, layers, top_k) expert
ids, row t = the experts token t went to in each routed MoE layer. `layers` counts the learned
routers in layer order; DeepSeek-V4's hash layers route by token id (`tid2eid`), the same on
both sides, so they are not in it.

Replay keeps the router in the graph: its logits are computed as usual and the gate weights are
recomputed from them at the replayed indices (softmax for Qwen3-MoE, sigmoid + normalisation +
scaling for DeepSeek), so the router still gets a gradient. With replayed indices equal to the
router's own, the output is bitwise the unpatched one.

The hooks are forward hooks on the router modules (registered once, idle unless a `capture`
context is open). They read only the router's outputs, never its parameters, so they work under
ZeRO-3, where the parameters are released right after the router's forward.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch


def _qwen3_weights(router, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    # Qwen3MoeTopKRouter: softmax in fp32, top-k values, optional renormalisation.
    w = torch.softmax(logits, dtype=torch.float, dim=-1).gather(1, idx)
    if router.norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype)


def _deepseek_v3_weights(router, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    w = logits.sigmoid().gather(1, idx)
    if router.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * router.routed_scaling_factor


def _deepseek_v4_weights(router, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    w = router.score_fn(logits).gather(1, idx)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * router.routed_scaling_factor


GATE_WEIGHTS: dict[str, Callable] = {
    "Qwen3MoeTopKRouter": _qwen3_weights,
    "DeepseekV3TopkRouter": _deepseek_v3_weights,
    "DeepseekV4TopKRouter": _deepseek_v4_weights,
}
"""Router class name -> gate weights at given indices from its logits: (router, logits (T, E),
idx (T, K) int64) -> (T, K). Each mirrors the class's own forward after its top-k."""


def routing_dtype(num_experts: int) -> np.dtype:
    """The narrowest unsigned type that holds every expert id."""
    if num_experts > 65536:
        raise ValueError(f"routing: {num_experts} experts do not fit uint16")
    return np.dtype(np.uint8 if num_experts <= 256 else np.uint16)


@dataclass(slots=True)
class RouterLayer:
    layer: int
    """Decoder layer index (the `N` in `model.layers.N`)."""
    name: str
    module: torch.nn.Module
    weights: Callable


def moe_routers(model: torch.nn.Module) -> list[RouterLayer]:
    """The learned routers of `model`, in layer order (hash routers excluded, see above)."""
    out: list[RouterLayer] = []
    for name, mod in model.named_modules():
        fn = GATE_WEIGHTS.get(type(mod).__name__)
        if fn is None:
            continue
        parts = name.split(".")
        layer = next((int(parts[i + 1]) for i, p in enumerate(parts[:-1])
                      if p == "layers" and parts[i + 1].isdigit()), len(out))
        out.append(RouterLayer(layer=layer, name=name, module=mod, weights=fn))
    return sorted(out, key=lambda r: r.layer)


@dataclass(slots=True)
class _Capture:
    replay: torch.Tensor | None
    """(T, layers, K) int64 on the model's device, or None (record only)."""
    mask: torch.Tensor | None
    """(T,) bool: tokens that take the replayed routing (the others keep their own)."""
    recorded: dict[int, torch.Tensor] = field(default_factory=dict)
    """slot -> (T, K) int64: the router's own choice."""
    agree: int = 0
    total: int = 0


class RoutingReplay:
    """Forward hooks on every learned router of an HF MoE model."""

    def __init__(self, model: torch.nn.Module):
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(f"routing replay: {type(model).__name__} has no supported MoE router "
                             f"(supported: {', '.join(GATE_WEIGHTS)})")
        first = self.routers[0].module
        self.num_layers = len(self.routers)
        self.top_k = int(first.top_k)
        self.num_experts = int(first.num_experts)
        self.dtype = routing_dtype(self.num_experts)
        self._active: _Capture | None = None
        self._handles = [r.module.register_forward_hook(self._hook(slot, r))
                         for slot, r in enumerate(self.routers)]

    @property
    def layers(self) -> list[int]:
        return [r.layer for r in self.routers]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @contextmanager
    def capture(self, replay_BLNK: torch.Tensor | None = None, mask_BL: torch.Tensor | None = None
                ) -> Iterator[_Capture]:
        """Within: every router records its choice; with `replay_BLNK` ((B, L, layers, K) expert
        ids of the forward's (B, L) input) the tokens where `mask_BL` is true take those experts.
        Yields the capture: `recorded` per slot and agreement counts over the masked tokens."""
        replay = mask = None
        if replay_BLNK is not None:
            if tuple(replay_BLNK.shape[2:]) != (self.num_layers, self.top_k):
                raise ValueError(f"routing replay: routing of shape {tuple(replay_BLNK.shape)}, "
                                 f"expected (B, L, {self.num_layers}, {self.top_k})")
            replay = replay_BLNK.reshape(-1, self.num_layers, self.top_k).long()
            mask = (torch.ones(replay.shape[0], dtype=torch.bool) if mask_BL is None
                    else mask_BL.reshape(-1).bool())
        if self._active is not None:
            raise RuntimeError("routing replay: captures do not nest")
        self._active = _Capture(replay=replay, mask=mask)
        try:
            yield self._active
        finally:
            self._active = None

    def recorded_BLNK(self, cap: _Capture, shape_BL: tuple[int, int]) -> torch.Tensor:
        """The recorded routing as (B, L, layers, K) int64 on the CPU."""
        slots = [cap.recorded[s].cpu() for s in range(self.num_layers)]
        return torch.stack(slots, dim=1).reshape(*shape_BL, self.num_layers, self.top_k)

    def _hook(self, slot: int, router: RouterLayer):
        def hook(module, args, output):
            cap = self._active
            if cap is None:
                return None
            logits, weights, own = output
            cap.recorded[slot] = own.detach()
            if cap.replay is None:
                return None
            if cap.replay.shape[0] != own.shape[0]:
                raise ValueError(f"routing replay: {cap.replay.shape[0]} tokens of routing for a "
                                 f"forward of {own.shape[0]} tokens ({router.name})")
            mask = cap.mask.to(own.device)
            want = cap.replay[:, slot].to(own.device)
            # Agreement counts each chosen expert of a masked token found in the other's set.
            hits = (own[:, :, None] == want[:, None, :]).any(-1)[mask]
            cap.agree += int(hits.sum())
            cap.total += int(hits.numel())
            use = torch.where(mask[:, None], want, own)
            return logits, router.weights(module, logits, use).to(weights.dtype), use
        return hook

"""Expert parallelism on the trainer ranks (`trainer.expert_parallel_size`, EP below).

Ranks form groups of EP consecutive ranks (`ep_group`); within one, rank j holds routed experts
[j * E/EP, (j+1) * E/EP) of every MoE layer, and the ranks with the same j across groups
(`edp_group`, the data-parallel replicas of that shard) hold the same experts. Each MoE layer's
`experts` module (HF's 3-D `gate_up_proj` / `down_proj`) is replaced by `ShardedExperts`: the
(token, expert) pairs go to the rank that owns the expert (`all_to_all_single`), that rank runs
the HF experts module itself over its slice (so each model's activation, e.g. V4's clamped
SwiGLU, and its grouped_mm / eager choice are unchanged), and the outputs come back and are
weighted and summed per token as HF does. The router stays HF's own module: routing replay
(`rl.models.routing` hooks the routers) and DeepSeek-V4's hash routing work unchanged.

Why our own layer and not DeepSpeed 0.19.8's: AutoEP (`deepspeed.module_inject.auto_ep`) swaps
the whole MoE block, router included, for its own, so routing replay and V4's hash routing
(`tid2eid[input_ids]`, sqrt-softplus scores) would have to be re-implemented inside it, and it
has no V4 preset; its ZeRO-3 expert placement is keyed to that layer class. `deepspeed.moe`'s
native layer is refused under ZeRO-3 (`_validate_zero3_moe_compatibility`).

So the expert shards live outside DeepSpeed: they are not registered parameters of the model
(ZeRO would partition and reduce them over all ranks, mixing different experts), and this class
owns their gradient reduction (over `edp_group` only), their AdamW (same hyper-parameters and
learning rate as DeepSpeed's), their checkpoint file and their gather for the weight sync. The
global gradient norm DeepSpeed clips with includes the experts' (`attach_grad_norm`), so
clipping and the reported `train/grad_norm` are those of the whole model, as with EP = 1.

With `offload` (`trainer.optimizer_offload` cpu or nvme) the shards' fp32 master weights and AdamW
moments live in host RAM (the master pinned when CUDA is present) and the step runs on the CPU:
one parameter at a time, its gradient comes to a reused host buffer in fp32, torch's fused CPU
AdamW updates the master and the moments, and the master goes back into the device shard in the
training dtype. The device keeps only the shards' weights and gradients. NVMe is not used for
them (DeepSpeed's swapper is built into its ZeRO optimizer): with `nvme` they stay in host RAM
too, and `launch.plan` counts them there.
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
"""The 3-D (experts, out, in) parameters of an HF experts module, sharded on dim 0."""


def _shape(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(p, "ds_shape", p.shape))  # ZeRO-3 partitions report their full shape


def is_experts_module(module: nn.Module) -> bool:
    """An HF routed-experts module: 3-D `gate_up_proj` and `down_proj` and `num_experts`
    (Qwen3MoeExperts, DeepseekV3Experts, DeepseekV4Experts)."""
    return hasattr(module, "num_experts") and all(
        isinstance(getattr(module, n, None), nn.Parameter) and len(_shape(getattr(module, n))) == 3
        for n in EXPERT_WEIGHTS)


@dataclass(slots=True)
class Stage:
    """One hop of the dispatch: an all-to-all over `group` (`size` ranks), each (token, expert)
    pick going to position `(owner // div) % size` of it, `owner` the pick's EP rank."""
    group: object
    size: int
    div: int

    def dest(self, owner: torch.Tensor) -> torch.Tensor:
        return (owner // self.div) % self.size


@dataclass(slots=True)
class EPGroups:
    ep_size: int
    ep_rank: int
    ep_group: object
    edp_group: object
    """The ranks holding the same expert shard (size world / EP)."""
    stages: list[Stage]
    """The dispatch's hops: one over `ep_group` (flat), or two when the EP group spans nodes
    (hierarchical): across nodes to the peer of the same local rank, then inside the node."""


def ranks_per_node(world_size: int) -> int:
    """Collective: the trainer ranks each node holds, from the ranks' host names, when every node
    holds the same number of consecutive ranks; 0 otherwise. `RL_EP_NODE_SIZE` overrides it
    (tests run "nodes" on one host with it)."""
    pinned = os.environ.get("RL_EP_NODE_SIZE")
    if pinned:
        if not pinned.isdigit() or int(pinned) < 1 or world_size % int(pinned):
            raise ValueError(f"RL_EP_NODE_SIZE={pinned!r}: expected a whole number of ranks per "
                             f"node that divides the {world_size} trainer ranks")
        return int(pinned)
    hosts: list[str] = [""] * world_size
    dist.all_gather_object(hosts, socket.gethostname())
    size = hosts.count(hosts[0])
    if world_size % size or any(hosts[i] != hosts[i - i % size] for i in range(world_size)) \
            or len(set(hosts)) != world_size // size:
        log.warning("trainer ranks are not placed node by node (ranks' hosts: %s): the "
                    "expert-parallel dispatch takes one hop, every row over its own link",
                    ", ".join(hosts))
        return 0
    return size


def make_groups(world_size: int, rank: int, ep_size: int, node_size: int = 0) -> EPGroups:
    """Collective: every rank creates every group, in the same order (torch requires it). With
    `node_size` (ranks per node, consecutive) smaller than `ep_size` and dividing it, the
    dispatch goes in two hops (`EPGroups.stages`); otherwise in one."""
    if world_size % ep_size:
        raise ValueError(f"expert_parallel_size {ep_size} does not divide {world_size} ranks")
    ep_group = edp_group = None
    for start in range(0, world_size, ep_size):
        g = dist.new_group(list(range(start, start + ep_size)))
        if start <= rank < start + ep_size:
            ep_group = g
    for j in range(ep_size):
        g = dist.new_group(list(range(j, world_size, ep_size)))
        if rank % ep_size == j:
            edp_group = g
    ep_rank = rank % ep_size
    stages = [Stage(ep_group, ep_size, 1)]
    if 1 < node_size < ep_size and ep_size % node_size == 0:
        nodes, base = ep_size // node_size, rank - ep_rank
        across = inside = None
        for start in range(0, world_size, ep_size):
            for j in range(node_size):  # the same local rank on each node of the EP group
                g = dist.new_group([start + m * node_size + j for m in range(nodes)])
                if start == base and ep_rank % node_size == j:
                    across = g
            for m in range(nodes):
                g = dist.new_group(list(range(start + m * node_size,
                                              start + (m + 1) * node_size)))
                if start == base and ep_rank // node_size == m:
                    inside = g
        stages = [Stage(across, nodes, node_size), Stage(inside, node_size, 1)]
    return EPGroups(ep_size=ep_size, ep_rank=ep_rank, ep_group=ep_group, edp_group=edp_group,
                    stages=stages)


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` of rows with a gradient (the backward sends the rows' gradients
    back the way they came)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


@dataclass(slots=True)
class _Hop:
    """What one dispatch hop sent, for the combine to come back: the source row of each sent
    row and the counts each way."""
    rows: torch.Tensor
    send: list[int]
    recv: list[int]
    group: object


def _dispatch(stage: Stage, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
              per_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, _Hop]:
    """One hop: each row of `x` (with its picks `experts` (R, K), -1 for none, and `weights`
    (R, K)) goes once to every position of the stage's group that owns one of its picks,
    carrying only those picks. Returns the received rows, picks, weights and the hop."""
    valid = experts >= 0
    dest = torch.where(valid, stage.dest(experts.clamp(min=0) // per_rank), -1)
    here = dest[:, None, :] == torch.arange(stage.size, device=x.device)[None, :, None]
    wanted = here.any(dim=2)                           # (R, size): row goes to that position
    to, rows = wanted.T.nonzero(as_tuple=True)         # by destination, then row
    send_counts = wanted.sum(dim=0)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=stage.group)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    picks = torch.where(here[rows, to], experts[rows], -1)
    got = torch.empty((sum(recv), picks.shape[1]), dtype=picks.dtype, device=picks.device)
    dist.all_to_all_single(got, picks.contiguous(), recv, send, group=stage.group)
    hop = _Hop(rows, send, recv, stage.group)
    return (_AllToAll.apply(x[rows], recv, send, stage.group), got,
            _AllToAll.apply(weights[rows], recv, send, stage.group), hop)


def _combine(hop: _Hop, y: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The way back of `hop`: the received rows' results return and are summed per source row."""
    y = _AllToAll.apply(y, hop.send, hop.recv, hop.group)
    return y.new_zeros((num_rows, *y.shape[1:])).index_add_(0, hop.rows, y)


def _local_copy(source: nn.Module, weights: dict[str, torch.Tensor]) -> nn.Module:
    """An instance of `source`'s class holding `weights` (this rank's experts): same plain
    attributes (config, activation limit...) and child modules (the activation), fresh hooks."""
    local = type(source).__new__(type(source))  # type: ignore[call-overload]  # lint baseline (issue 39)
    nn.Module.__init__(local)
    internals = set(local.__dict__)  # nn.Module's own (parameters, hooks...): keep fresh
    local.__dict__.update({k: v for k, v in source.__dict__.items() if k not in internals})
    for name, child in source._modules.items():
        local.add_module(name, child)
    for name, w in weights.items():
        local.register_parameter(name, nn.Parameter(w))
    local.num_experts = next(iter(weights.values())).shape[0]
    return local


class ShardedExperts(nn.Module):
    """Drop-in for an HF experts module: forward(hidden (T, H), top_k_index (T, K),
    top_k_weights (T, K)) -> (T, H), computing the experts this rank does not hold remotely.

    A token travels once to each rank that owns one of its picks (not once per pick), and the
    owner sends back one row per token: its picks' outputs, weighted and summed. When the EP
    group spans nodes (`EPGroups.stages`, two hops), a token crosses to another node once: to
    the rank of the same local index there, which forwards it inside its node and sums what
    comes back before returning it, as DeepEP's internode dispatch and combine do."""

    def __init__(self, local: nn.Module, num_experts: int, groups: EPGroups):
        super().__init__()
        # Not a registered child: its parameters must stay out of DeepSpeed (module docstring).
        object.__setattr__(self, "local", local)
        self.num_experts = num_experts
        self.num_local = local.num_experts
        self.groups = groups

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        x, picks, weights, hops = hidden_states, top_k_index, top_k_weights, []
        for stage in self.groups.stages:
            n = x.shape[0]
            x, picks, weights, hop = _dispatch(stage, x, picks, weights, self.num_local)
            hops.append((hop, n))
        # Here: rows with this rank's picks only. Each (row, pick) through the HF module with
        # weight 1 (exact), then weighted by its routing weight and summed per row.
        row, slot = (picks >= 0).nonzero(as_tuple=True)
        ids = picks[row, slot] - self.groups.ep_rank * self.num_local
        ones = torch.ones(ids.shape[0], 1, dtype=top_k_weights.dtype, device=x.device)
        y = self.local(x[row], ids[:, None], ones) * weights[row, slot, None]
        y = x.new_zeros(x.shape).index_add_(0, row, y.to(x.dtype))
        for hop, n in reversed(hops):
            y = _combine(hop, y, n)
        return y


class ExpertParallel:
    """This rank's expert shards of `model` (replaced in place at construction), their optimizer,
    gradient reduction, checkpoint and gather. Collective methods say so."""

    def __init__(self, model: nn.Module, groups: EPGroups, device: torch.device,
                 offload: bool = False):
        self.groups = groups
        self.offload = offload
        """The optimizer state (fp32 master, AdamW moments) is in host RAM, stepped on the CPU."""
        self.layers: dict[str, ShardedExperts] = {}
        found = [(n, m) for n, m in model.named_modules() if is_experts_module(m)]
        if not found:
            raise ValueError(f"expert_parallel_size {groups.ep_size}: {type(model).__name__} has "
                             "no routed experts module")
        for name, mod in found:
            num = int(mod.num_experts)
            if num % groups.ep_size:
                raise ValueError(f"expert_parallel_size {groups.ep_size} does not divide the "
                                 f"{num} experts of {name}")
            per = num // groups.ep_size
            lo = groups.ep_rank * per
            params = [getattr(mod, w) for w in EXPERT_WEIGHTS]
            with _full(params):
                weights = {w: p.detach()[lo:lo + per].clone().to(device)
                           for w, p in zip(EXPERT_WEIGHTS, params)}
            sharded = ShardedExperts(_local_copy(mod, weights), num, groups)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, sharded)
            self.layers[name] = sharded
        self.params: dict[str, nn.Parameter] = {
            f"{name}.{w}": getattr(layer.local, w)
            for name, layer in self.layers.items() for w in EXPERT_WEIGHTS}
        # fp32 master copies for AdamW when the model trains in bf16 (as DeepSpeed keeps them);
        # offloaded, always a host copy (pinned: its update is copied back to the GPU each step).
        pin = offload and torch.cuda.is_available()
        if offload:
            self.master = {n: nn.Parameter(torch.empty(p.shape, dtype=torch.float32,
                                                       pin_memory=pin).copy_(p.detach()))
                           for n, p in self.params.items()}
            # One parameter's gradient at a time (the step goes parameter by parameter): host RAM
            # holds one fp32 gradient of the largest shard, not one per parameter. A staging
            # buffer in the training dtype keeps dtype conversions on the host (a GPU-side
            # conversion would allocate a transient fp32 copy on the GPU).
            largest = max(p.numel() for p in self.params.values())
            self._grad32 = torch.empty(largest, dtype=torch.float32, pin_memory=pin)
            dtype = next(iter(self.params.values())).dtype
            self._stage = (None if dtype == torch.float32 else
                           torch.empty(largest, dtype=dtype, pin_memory=pin))
        else:
            self.master = {n: p if p.dtype == torch.float32 else
                           nn.Parameter(p.detach().float().clone()) for n, p in self.params.items()}
        self.optimizer: torch.optim.Optimizer | None = None
        self.grad_norm: torch.Tensor | None = None

    # ---- shapes and gathers --------------------------------------------------------------
    def full_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Full (all experts) shape and dtype of each sharded parameter, by its HF name."""
        return {n: ((p.shape[0] * self.groups.ep_size, *p.shape[1:]), p.dtype)
                for n, p in self.params.items()}

    def gather(self, name: str) -> torch.Tensor:
        """Collective over the EP group: the full (E, ...) parameter `name`."""
        p = self.params[name].detach()
        parts = [torch.empty_like(p) for _ in range(self.groups.ep_size)]
        dist.all_gather(parts, p.contiguous(), group=self.groups.ep_group)
        return torch.cat(parts)

    # ---- optimizer -----------------------------------------------------------------------
    def make_optimizer(self, lr: float, betas, weight_decay: float) -> None:
        params = list(self.master.values())
        # Offloaded: torch's fused AdamW on the CPU (`_fused_adamw`, one vectorised pass over
        # parameter, gradient and both moments per tensor; the unfused CPU path runs each
        # elementwise op as its own pass, several times the memory traffic that bounds a host
        # step of 17B expert parameters per rank at V4-Flash EP 16). Not DeepSpeedCPUAdam: it is
        # a C++ extension compiled at first use (minutes), and its object carries beta^t from
        # call to call, so a resumed run's bias correction differs in the last bit.
        self.optimizer = torch.optim.AdamW(params, lr=lr, betas=tuple(betas),
                                           weight_decay=weight_decay,
                                           fused=True if self.offload else None)

    def grads_finite(self) -> bool:
        return all(p.grad is None or bool(torch.isfinite(p.grad).all())
                   for p in self.params.values())

    def reduce_grads(self, world_size: int) -> None:
        """Collective: before DeepSpeed's step. Each shard's gradient holds its EP group's
        tokens (the backward all-to-all brought them), scaled by world_size like every loss the
        worker backpropagates: summed over the replicas and divided by world_size it is the
        mean gradient DeepSpeed gives its own parameters. Sets `grad_norm` (global, for
        `attach_grad_norm`)."""
        sq = torch.zeros((), dtype=torch.float32, device=next(iter(self.params.values())).device)
        for p in self.params.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if dist.get_world_size(self.groups.edp_group) > 1:
                dist.all_reduce(p.grad, group=self.groups.edp_group)
            p.grad.div_(world_size)
            sq += p.grad.float().pow(2).sum()
        dist.all_reduce(sq, group=self.groups.ep_group)  # the replicas hold the same sum
        self.grad_norm = sq.sqrt()

    def step(self, lr: float, total_norm: float, clip: float) -> None:
        """After DeepSpeed applied its step: clip by the global norm as DeepSpeed does, update."""
        scale = max(((total_norm + 1e-6) / clip) if clip > 0 else 1.0, 1.0)
        for group in self.optimizer.param_groups:  # type: ignore[union-attr]  # lint baseline (issue 39)
            group["lr"] = lr
        if self.offload:
            self._step_offloaded(scale)
            return
        for name, p in self.params.items():
            # In place on fp32 gradients (`float()` is then the tensor itself): for an fp32
            # parameter, its own master.
            self.master[name].grad = p.grad.float().div_(scale)
        self.optimizer.step()  # type: ignore[union-attr]  # lint baseline (issue 39)
        with torch.no_grad():
            for name, p in self.params.items():
                if self.master[name] is not p:
                    p.copy_(self.master[name])
        self.zero_grad()

    @torch.no_grad()
    def _step_offloaded(self, scale: float) -> None:
        """Parameter by parameter: gradient to the host in fp32, clipped as `step` clips, the
        CPU AdamW step (it skips parameters without a gradient: only this one moves), the new
        master back into the device shard in its dtype."""
        for name, p in self.params.items():
            m, n = self.master[name], p.numel()
            g = self._grad32[:n].view_as(m)
            if self._stage is None:
                g.copy_(p.grad)
            else:
                stage = self._stage[:n].view_as(p)
                stage.copy_(p.grad)
                g.copy_(stage)
            m.grad = g.div_(scale)
            self.optimizer.step()  # type: ignore[union-attr]  # lint baseline (issue 39)
            m.grad = None
            if self._stage is None:
                p.copy_(m)
            else:
                stage.copy_(m)  # fp32 -> training dtype on the host, then one copy to the device
                p.copy_(stage)
        self.zero_grad()

    def zero_grad(self) -> None:
        for name, p in self.params.items():
            p.grad = None
            self.master[name].grad = None

    # ---- checkpoint ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This shard's fp32 master weights and optimizer state (host tensors when offloaded;
        torch.load puts them back where they were saved from). Not copies: save it at once."""
        return {"ep_size": self.groups.ep_size, "ep_rank": self.groups.ep_rank,
                "offload": self.offload,
                "master": {n: m.detach() for n, m in self.master.items()},
                "optimizer": self.optimizer.state_dict()}  # type: ignore[union-attr]  # lint baseline (issue 39)

    def load_state_dict(self, state: dict, where: Path) -> None:
        if (state["ep_size"], state["ep_rank"]) != (self.groups.ep_size, self.groups.ep_rank):
            raise RuntimeError(f"{where}: written with expert_parallel_size {state['ep_size']} "
                               f"(shard {state['ep_rank']}), this run has "
                               f"{self.groups.ep_size} (shard {self.groups.ep_rank})")
        # Across the two modes the state would load (both are torch AdamW) but the checkpoint's
        # param groups carry the `fused` flag of the run that wrote it, and fused and unfused
        # steps round differently: refused, rather than resumed not quite as it would have run.
        # (Files from before offloading existed have no "offload": they were not offloaded.)
        if state.get("offload", False) != self.offload:
            raise RuntimeError(f"{where}: written with the experts' optimizer state "
                               f"{'in host RAM' if state.get('offload') else 'on the device'} "
                               "(trainer.optimizer_offload "
                               f"{'cpu/nvme' if state.get('offload') else 'none'}); this run "
                               f"{'offloads' if self.offload else 'does not offload'} it")
        with torch.no_grad():
            for name, m in self.master.items():
                m.copy_(state["master"][name])
                if m is not self.params[name]:
                    self.params[name].copy_(m)
        self.optimizer.load_state_dict(state["optimizer"])  # type: ignore[union-attr]  # lint baseline (issue 39)


def attach_grad_norm(optimizer, ep: ExpertParallel) -> None:
    """Make DeepSpeed's ZeRO optimizer count the experts' gradient norm in its global norm (the
    one it clips with and reports). Wraps the instance's norm method: stage 3
    `_get_norm_groups` (a list of per-group norms), stage 2 `scaled_global_norm` (one norm);
    both are scaled by the loss scale (1 outside fp16). (ZeRO-1 in bf16 runs DeepSpeed's
    BF16_Optimizer, which has neither: the config refuses EP below stage 2.)"""
    from deepspeed.runtime.utils import combine_grad_norm_groups

    def extra():
        return ep.grad_norm.to(torch.float32) * float(getattr(optimizer, "loss_scale", 1.0))

    if hasattr(optimizer, "_get_norm_groups"):
        inner_groups = optimizer._get_norm_groups

        def norm_groups():
            groups = inner_groups()
            device = next((n.device for n in groups if torch.is_tensor(n)), torch.device("cpu"))
            return [*groups, extra().to(device)]
        optimizer._get_norm_groups = norm_groups
    elif hasattr(optimizer, "scaled_global_norm"):
        inner = optimizer.scaled_global_norm

        def scaled_global_norm(norm_type=2):
            own = inner(norm_type)
            return combine_grad_norm_groups([own, extra().to(own.device)])
        optimizer.scaled_global_norm = scaled_global_norm
    else:
        raise ValueError("expert parallelism needs ZeRO stage 2 or 3 "
                         f"(got optimizer {type(optimizer).__name__})")


@contextlib.contextmanager
def _full(params: list[nn.Parameter]):
    """The full parameters, also when ZeRO-3 partitioned them at load time (collective then)."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield
    else:
        yield

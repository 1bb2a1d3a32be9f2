"""TrainerWorker: one data-parallel rank holding a DeepSpeed ZeRO engine around the HF actor.

A plain class: Ray hosts N of them as actors (rl/cluster/groups.py); on a machine without Ray the
same class runs in plain processes. Every public method that touches parameters is a collective
under ZeRO: the driver must call it on all ranks with the same arguments.

The batch is a `rl.trainer.batch.TrainBatch` the driver builds, identical on every rank (its
`routing` only with `algorithm.routing_replay: r3`, format in rl/rollout/routing.py).
Each rank trains on its strided shard (sample i goes to rank i % world_size); all ranks run the
same number of micro-batches (short ranks pad with zero-weight ones) so ZeRO's collectives match.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rl import safe_load
from rl.checkpoint_files import release_files, seal_files, sha256_files
from rl.config import AlgorithmConfig, SyncConfig, TrainerConfig
from rl.faults import TrainerFaults
from rl.trainer import losses, packing
from rl.trainer.batch import TrainBatch, TrainStats
from rl.trainer.checkpoint_io import RecordingCheckpointEngine, rank_files
from rl.trainer.microbatch import (Micro, loss_count, micro_batches, micro_policy_loss,
                                   pad_batch)
from rl.trainer.packing import check_packable, model_inputs, unpack
from rl.trainer.weights import WeightSender


@dataclass(kw_only=True, slots=True)
class RankInfo:
    rank: int
    world_size: int
    master_addr: str
    master_port: int


def _lr_lambda(cfg: TrainerConfig, total_steps: int):
    def fn(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        span = max(total_steps - cfg.warmup_steps, 1)
        progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return fn


def ds_config(cfg: TrainerConfig, bf16: bool) -> dict:
    """DeepSpeed config, with the memory settings the planner checks (optimizer/parameter offload
    and where it goes)."""
    zero: dict = {
        "stage": cfg.zero_stage,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "stage3_param_persistence_threshold": 0,
    }
    if cfg.optimizer_offload != "none":
        zero["offload_optimizer"] = ({"device": "cpu", "pin_memory": True}
                                     if cfg.optimizer_offload == "cpu" else
                                     {"device": "nvme", "nvme_path": cfg.nvme_path,
                                      "pin_memory": True})
    if cfg.param_offload != "none":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.grad_clip,
        "bf16": {"enabled": bf16},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        # Micro-batches are cut by a token budget, so their number varies per mini-batch: the
        # caller owns the accumulation boundary (backward() accumulates locally, step() reduces
        # and updates). DeepSpeed's managed counting silently dropped all but the last
        # micro-batch's gradient under ZeRO-3 here (see tests/rl/trainer).
        "managed_gradient_accumulation": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


@dataclass(slots=True)
class Frozen:
    """A micro-batch's log-probs (B, L-1) under weights that stay put during the step."""
    old: torch.Tensor
    """The actor's before the step's first update (the PPO ratio's denominator)."""
    ref: torch.Tensor | None
    """The frozen reference model's (None without `algorithm.kl_coef`)."""


@dataclass(slots=True)
class _StepSums:
    """A step's rank-local statistics over its real (weight > 0) micro-batches."""
    sums: dict[str, float] = field(default_factory=dict)
    """`policy_loss` statistics summed (means once divided by `count`)."""
    extremes: dict[str, float] = field(default_factory=dict)
    """The `*_max` / `*_min` statistics: max / min over the micro-batches."""
    count: int = 0
    num_tokens: int = 0
    """Input tokens (prompt + response) trained on, every epoch counted."""
    grad_norms: list[float] = field(default_factory=list)
    """The global gradient norm of each applied optimizer step (when DeepSpeed computes one)."""
    skipped: int = 0
    """Optimizer steps skipped (non-finite loss or gradients), the same on every rank."""

    def add(self, stats: dict[str, float], num_tokens: int) -> None:
        for k, v in stats.items():
            if k.endswith("_max"):
                self.extremes[k] = max(self.extremes.get(k, -math.inf), v)
            elif k.endswith("_min"):
                self.extremes[k] = min(self.extremes.get(k, math.inf), v)
            else:
                self.sums[k] = self.sums.get(k, 0.0) + v
        self.count += 1
        self.num_tokens += num_tokens


def _old_logprobs_by_sample(mbs: list[Micro], frozen: list[Frozen]) -> dict[int, list[float]]:
    """The trainer's side of each sample's log-probs, for the trajectory log (this rank's
    shard, padding micro-batches left out)."""
    out: dict[int, list[float]] = {}
    for mb, f in zip(mbs, frozen):
        if mb.weight > 0:
            lp, mask = f.old.cpu(), mb.resp_mask[:, 1:].bool()
            for row, i in enumerate(mb.index):
                out[i] = lp[row][mask[row]].tolist()
    return out


class PeerSaveFailed(RuntimeError):
    """This rank wrote its part of the checkpoint, but another rank's write failed."""


class TrainerWorker:
    def __init__(self, cfg: TrainerConfig, algo: AlgorithmConfig, sync: SyncConfig, model_dir: str,
                 dtype: str, rank_info: RankInfo, seed: int, total_optimizer_steps: int):
        from rl.signals import shield_worker
        shield_worker()
        self.faults = TrainerFaults.from_env()  # injected faults (tests only), read once
        self.faults.check_init(rank_info.rank)
        self.cfg, self.algo, self.sync_cfg = cfg, algo, sync
        self.rank, self.world_size = rank_info.rank, rank_info.world_size
        torch.set_num_threads(cfg.torch_threads)
        self.device = self._pick_device()
        self.dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size),
                          LOCAL_RANK="0" if self.device.type == "cpu" else str(self.device.index or 0),
                          MASTER_ADDR=rank_info.master_addr, MASTER_PORT=str(rank_info.master_port))
        self._seed_everything(seed)
        self.ep = None  # rl.trainer.expert_parallel.ExpertParallel with expert_parallel_size > 1
        self.lr_horizon = total_optimizer_steps
        """Optimizer steps the LR schedule decays over: the run's at its start, kept by every
        resume (`load`), so a changed num_steps neither stretches nor squeezes the schedule."""
        self.engine, self.ref_model = self._build(model_dir, total_optimizer_steps)
        self.sender = WeightSender(self.engine.module, zero_stage=cfg.zero_stage,
                                   is_sender=self.rank == 0, sync=sync, device=self.device,
                                   experts=self.ep)
        self.optimizer_steps = 0
        self.replay = None
        if algo.routing_replay != "off":
            from rl.trainer.replay import TrainerReplay
            self.replay = TrainerReplay(self.engine.module, algo.routing_replay, algo.tis_cap)  # type: ignore[arg-type]  # lint baseline (issue 39)

    # ---- setup -------------------------------------------------------------------------
    def _pick_device(self) -> torch.device:
        want = self.cfg.device
        if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
            if not torch.cuda.is_available():
                raise RuntimeError("trainer.device is 'cuda' but no CUDA device is visible")
            # Plain processes (no LOCAL_RANK) see every GPU: rank r takes GPU r. A Ray actor sees
            # only its own, so the modulo makes that GPU 0 whatever its rank.
            local = int(os.environ.get("LOCAL_RANK", self.rank)) % torch.cuda.device_count()
            torch.cuda.set_device(local)
            return torch.device("cuda", local)
        return torch.device("cpu")

    def _seed_everything(self, seed: int) -> None:
        # Per-rank streams: the same seed on every rank would make dropout etc. identical.
        s = seed * 1000 + self.rank
        random.seed(s)
        np.random.seed(s % 2**32)
        torch.manual_seed(s)

    def _build(self, model_dir: str, total_steps: int):
        import deepspeed
        import torch.distributed as dist

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            # The rendezvous store listens on the master's address only (torch's env://
            # rendezvous listens on every interface).
            from rl.cluster.groups import tcp_store
            store = tcp_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              self.world_size, self.rank == 0,
                              dist.constants.default_pg_timeout)
            dist.init_process_group(backend, store=store, rank=self.rank,
                                    world_size=self.world_size)
        bf16 = self.dtype == torch.bfloat16
        config = ds_config(self.cfg, bf16)
        # The frozen reference is loaded before ZeRO-3's load-time partitioning is switched on: it
        # is not wrapped by DeepSpeed, so it must hold full tensors.
        ref = None
        if self.algo.kl_coef > 0:
            ref = self._load(model_dir, self.device).eval()
            for p in ref.parameters():
                p.requires_grad_(False)
        self._hf_ds = None
        if self.cfg.zero_stage == 3:
            # Keeps transformers' from_pretrained partitioning at load time (kept alive on purpose).
            from transformers.integrations import HfDeepSpeedConfig
            self._hf_ds = HfDeepSpeedConfig(config)
        model = self._load(model_dir, torch.device("cpu"))
        model.config.use_cache = False
        if self.cfg.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        if self.cfg.expert_parallel_size > 1:
            from rl.trainer import expert_parallel as ep
            groups = ep.make_groups(self.world_size, self.rank, self.cfg.expert_parallel_size,
                                    ep.ranks_per_node(self.world_size))
            # Offloaded (cpu and nvme alike: host RAM, expert_parallel's docstring says why).
            self.ep = ep.ExpertParallel(model, groups, self.device,  # type: ignore[assignment]  # lint baseline (issue 39); experts leave `model`
                                        offload=self.cfg.optimizer_offload != "none")
            self.ep.make_optimizer(self.cfg.lr, self.cfg.betas, self.cfg.weight_decay)  # type: ignore[attr-defined]  # lint baseline (issue 39)
        params = [p for p in model.parameters() if p.requires_grad]
        if "offload_optimizer" in config["zero_optimization"]:
            # The optimizer step runs on the host: DeepSpeed's vectorised CPU Adam (JIT-built once).
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            optim = DeepSpeedCPUAdam(params, lr=self.cfg.lr, betas=tuple(self.cfg.betas),
                                     weight_decay=self.cfg.weight_decay, adamw_mode=True)
        else:
            optim = torch.optim.AdamW(params, lr=self.cfg.lr, betas=tuple(self.cfg.betas),
                                      weight_decay=self.cfg.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(optim, _lr_lambda(self.cfg, total_steps))
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optim, lr_scheduler=sched,
                                               config=config, dist_init_required=False)
        buffers_to(engine.module, self.device)
        # DeepSpeed loads its files with weights_only=False: resumes go through rl.safe_load
        engine.checkpoint_engine = RecordingCheckpointEngine(
            safe_load.SafeCheckpointEngine(engine.checkpoint_engine))
        if self.device.type == "cuda":
            from rl.trainer import alignment
            alignment.install(engine.module)
        if self.ep is not None:
            from rl.trainer.expert_parallel import attach_grad_norm
            attach_grad_norm(engine.optimizer, self.ep)
        return engine, ref

    def _load(self, model_dir: str, device: torch.device):
        from rl.models.loading import load_model
        model = load_model(model_dir, dtype=self.dtype, device=device,  # type: ignore[arg-type]  # lint baseline (issue 39)
                           attention=self.cfg.attention_kernel, runs_on=self.device)
        if self.cfg.pack_sequences:
            check_packable(model.config.to_dict(), self.cfg.attention_kernel)
            packing.install(model)
        if self.cfg.chunked_lm_head:  # before DeepSpeed hooks the modules (ZeRO-3 gathers)
            from rl.trainer.lm_head import LogprobHead
            LogprobHead.install(model)
        return model

    # ---- log-probs -----------------------------------------------------------------------
    def _forward_logprobs(self, model, mb: Micro, entropy: str = "none"
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-prob (B, L-1) of each next token, its entropy (B, L-1) or None). `entropy`:
        `none`; `metric` (detached: logged only, no graph kept for it); `loss` (differentiable).
        `model` is the DeepSpeed engine (training: its forward advances ZeRO-3's micro-step) or
        an HF model (scoring, the reference)."""
        kwargs, targets, packed = model_inputs(  # rl.trainer.packing
            mb.input_ids, mb.attention_mask, self.cfg.pack_sequences, self.device)
        logp, ent = self._logprobs_of(model, kwargs, targets, entropy)
        if packed is not None:
            logp = unpack(logp, packed)
            ent = None if ent is None else unpack(ent, packed)
        return logp, ent

    def _logprobs_of(self, model, kwargs: dict, targets: torch.Tensor, entropy: str
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_forward_logprobs` of the model's inputs `kwargs` and their next tokens `targets`."""
        if self.cfg.chunked_lm_head:  # rl.trainer.lm_head: no (B, L-1, V) logits
            head = getattr(model, "module", model).get_output_embeddings()
            with head.logprobs_of(targets, entropy=entropy != "none",
                                  chunk_rows=self.cfg.lm_head_chunk_rows):
                pairs = model(**kwargs).logits  # (B, L-1, 2): [log-prob, entropy]
            ent = pairs[..., 1] if entropy == "loss" else pairs[..., 1].detach()
            return pairs[..., 0], ent if entropy != "none" else None
        logits = model(**kwargs).logits[:, :-1]  # token_logprobs upcasts chunk by chunk
        logp = losses.token_logprobs(logits, targets)
        if entropy == "loss":
            return logp, losses.entropy_from_logits(logits)
        if entropy == "metric":
            with torch.no_grad():
                return logp, losses.entropy_from_logits(logits.detach())
        return logp, None

    @torch.no_grad()
    def score(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        """Per-token log-probs of the responses (all ranks compute all; collective under ZeRO-3)."""
        self.engine.module.eval()
        batch = pad_batch(prompt_ids, response_ids)
        logp, _ = self._forward_logprobs(self.engine.module, batch)
        self.engine.module.train()
        return [logp[i, batch.resp_mask[i, 1:].bool()].tolist() for i in range(len(prompt_ids))]

    # ---- training ------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch, step: int) -> TrainStats:
        """PPO epochs x mini-batches over this rank's shard: the frozen log-probs once, then one
        `_update` per mini-batch. Returns rank-agreed metrics and this rank's old log-probs."""
        t0 = time.perf_counter()
        mine = list(range(self.rank, len(batch), self.world_size))
        advantages = torch.tensor(batch.advantages, dtype=torch.float32)
        mbs = micro_batches(batch, mine, self.cfg.micro_batch_tokens, self.world_size,
                            packed=self.cfg.pack_sequences)
        with torch.profiler.record_function("rl.frozen_logprobs"):
            frozen = self._frozen_logprobs(mbs)
        old_logprobs = _old_logprobs_by_sample(mbs, frozen)
        acc = _StepSums()
        rng = random.Random(step * 7919 + 17)
        for _ in range(self.cfg.ppo_epochs):
            order = list(range(len(mbs)))
            rng.shuffle(order)  # same permutation on every rank (same seed)
            # Fewer micro-batches than mini-batches leaves some splits empty: an optimizer step
            # without a backward breaks ZeRO-3, so they are skipped (the same on every rank).
            for group in np.array_split(np.array(order, dtype=np.int64), self.cfg.num_mini_batches):
                if len(group):
                    with torch.profiler.record_function("rl.update"):
                        self._update([(mbs[i], frozen[i]) for i in group], advantages, step, acc)
        metrics = self._reduce_stats(acc, time.perf_counter() - t0)
        return TrainStats(metrics=metrics, old_logprobs=old_logprobs)

    @torch.no_grad()
    def _frozen_logprobs(self, mbs: list[Micro]) -> list[Frozen]:
        """The old (behaviour-at-train-time) and reference log-probs of every micro-batch, once,
        before any update (under routing replay, the old pass also records what to replay)."""
        self.engine.module.eval()
        if self.replay is not None:
            self.replay.reset()
        out = []
        for mb in mbs:
            if self.replay is not None:
                old = self.replay.old_pass(
                    lambda m=mb: self._forward_logprobs(self.engine.module, m)[0], mb)
            else:
                old, _ = self._forward_logprobs(self.engine.module, mb)
            ref = None
            if self.ref_model is not None:
                ref, _ = self._forward_logprobs(self.ref_model, mb)
            out.append(Frozen(old=old, ref=ref))
        self.engine.module.train()
        return out

    def _update(self, group: list[tuple[Micro, Frozen]], advantages: torch.Tensor, step: int,
                acc: _StepSums) -> None:
        """One mini-batch: forward and backward over its micro-batches (gradients accumulate),
        then one optimizer step if the loss and gradients are finite on every rank."""
        denom = self._global_denominator([mb for mb, _ in group])
        finite = True
        for mb, frozen in group:
            # Replay spans forward and backward (activation checkpointing re-runs the forward
            # inside backward).
            with self._replaying(mb):
                loss, st = self._micro_loss(mb, frozen, advantages, denom, step)
                finite = finite and bool(torch.isfinite(loss))
                # DeepSpeed averages gradients over ranks; the denominator is already global.
                with torch.profiler.record_function("rl.backward"):
                    self.engine.backward(loss * mb.weight * self.world_size)
            if mb.weight > 0:
                acc.add(st, int(mb.attention_mask.sum()))
        with torch.profiler.record_function("rl.optimizer_step"):
            applied = self._step_if_finite(finite)
        acc.skipped += not applied
        norm = self.engine.get_global_grad_norm() if applied else None
        if norm is not None:  # None: not computed (ZeRO-0)
            acc.grad_norms.append(float(norm))
        self.optimizer_steps += int(applied)

    def _replaying(self, mb: Micro):
        """The routing replay context of an update pass over `mb` (none without replay)."""
        return self.replay.update_pass(mb) if self.replay is not None else contextlib.nullcontext()

    def _micro_loss(self, mb: Micro, frozen: Frozen, advantages: torch.Tensor, denom: float,
                    step: int) -> tuple[torch.Tensor, dict[str, float]]:
        """The policy loss of one micro-batch under the current weights, with its statistics."""
        # Through the engine (not engine.module): DeepSpeed's forward advances ZeRO-3's
        # micro-step, without which each micro-batch overwrites the last one's grads.
        logp, ent = self._forward_logprobs(self.engine, mb,
                                           "loss" if self.algo.entropy_coef > 0 else "metric")
        loss, st = micro_policy_loss(logp, frozen.old, frozen.ref, ent,
                                     advantages[mb.index].to(self.device), mb, self.algo, denom)
        return self.faults.poison(loss, self.rank, step), st

    def _step_if_finite(self, finite: bool) -> bool:
        """The mini-batch's optimizer step, taken if its loss was `finite` and its gradients are
        finite on every rank, else dropped on all. Every rank takes the same branch (the flag is
        all-reduced), so ZeRO's collectives stay matched and no rank updates weights the others
        drop. Returns whether the step was applied (False too for DeepSpeed's own overflow
        skip)."""
        if self._finite_on_all_ranks(finite and self._local_grads_finite()):
            if self.ep is not None:
                lr = self.engine.get_lr()[0]  # this step's (step() moves the scheduler)
                self.ep.reduce_grads(self.world_size)
            self.engine.step()
            applied = self.engine.was_step_applied()
            if self.ep is not None and applied:
                self.ep.step(lr, float(self.engine.get_global_grad_norm()), self.cfg.grad_clip)
        else:
            self._drop_gradients()
            applied = False
        if self.ep is not None:
            self.ep.zero_grad()
        return applied

    def _reduce_stats(self, acc: _StepSums, seconds: float) -> dict[str, float]:
        """The step's metrics, the same on every rank: means over ranks, true max/min for
        extremes, throughput summed over ranks. grad_norm and lr are already global."""
        import torch.distributed as dist
        stats = {f"train/{k}": v / max(acc.count, 1) for k, v in acc.sums.items()}
        stats.update({f"train/{k}": v for k, v in acc.extremes.items()})
        stats["train/tokens_per_s"] = acc.num_tokens / max(seconds, 1e-9)
        out: dict[str, float] = {}
        for op, keys in ((dist.ReduceOp.SUM, [k for k in stats if not k.endswith(("_max", "_min"))]),
                         (dist.ReduceOp.MAX, [k for k in stats if k.endswith("_max")]),
                         (dist.ReduceOp.MIN, [k for k in stats if k.endswith("_min")])):
            keys = sorted(keys)
            if not keys:
                continue
            # On the collective's device: NCCL (GPU trainers) cannot reduce CPU tensors.
            t = torch.tensor([stats[k] for k in keys], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=op)
            if op == dist.ReduceOp.SUM:
                t /= self.world_size
            out.update(zip(keys, t.tolist()))
        out["train/tokens_per_s"] *= self.world_size
        # Over the applied optimizer steps; NaN when none reported one (all skipped, or ZeRO-0).
        out["train/grad_norm"] = float(np.mean(acc.grad_norms)) if acc.grad_norms else float("nan")
        out["train/skipped"] = float(acc.skipped)
        out["train/lr"] = float(self.engine.get_lr()[0])
        if self.replay is not None:
            from rl.trainer.replay import reduce_stats
            local = self.replay.stats()
            keys = sorted(local)
            t = torch.tensor([local[k] for k in keys], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            out.update(reduce_stats(dict(zip(keys, t.tolist())), self.replay.mode))
        return out

    def _finite_on_all_ranks(self, local: bool) -> bool:
        import torch.distributed as dist
        t = torch.tensor([1.0 if local else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item() == 1.0)

    def _local_grads_finite(self) -> bool:
        """The gradients this rank holds before `engine.step()`: `p.grad` under ZeRO-0/1 (reduced
        in `step`), this rank's reduced partition under ZeRO-3. (ZeRO-2 partitions are reachable
        only inside DeepSpeed, whose `step` skips a non-finite global norm itself.)"""
        from deepspeed.utils import safe_get_local_grad
        if self.ep is not None and not self.ep.grads_finite():
            return False
        for p in self.engine.module.parameters():
            if not p.requires_grad:
                continue
            g = p.grad if p.grad is not None or not hasattr(p, "ds_id") else safe_get_local_grad(p)
            if g is not None and g.numel() and not bool(torch.isfinite(g).all()):
                return False
        return True

    def _drop_gradients(self) -> None:
        """Skip the optimizer step on this rank (all ranks do it together), the way DeepSpeed
        treats an fp16 overflow: no optimizer update (weights and Adam moments untouched), no LR
        scheduler step, and the accumulated gradients cleared so the next mini-batch starts
        from zero. Under ZeRO-3 `zero_grad` resets the micro-step counter, so the next backward
        overwrites the partitions; they are zeroed too so that a parameter without a gradient
        next time (an unrouted expert) does not carry this step's NaN."""
        if self.cfg.zero_stage == 0:
            self.engine.zero_grad()
            return
        if self.ep is not None:  # a non-finite expert norm: ZeRO-1/2's own step skips too
            self.ep.grad_norm = torch.tensor(float("nan"))
        if self.cfg.zero_stage in (1, 2):
            # ZeRO-1/2 keep the partitions inside the optimizer: its own step() drops a step
            # whose global gradient norm is non-finite, and it is one for a non-finite loss.
            self.engine.step()
            if self.engine.was_step_applied():
                raise RuntimeError("ZeRO-%d applied a step with a non-finite loss (its gradients "
                                   "were finite): use zero_stage 0 or 3" % self.cfg.zero_stage)
            return
        from deepspeed.utils import safe_set_local_grad
        self.engine.optimizer.zero_grad(set_to_none=True)
        for p in self.engine.module.parameters():
            if p.requires_grad and hasattr(p, "ds_id"):
                safe_set_local_grad(p, torch.zeros_like(p.ds_tensor, dtype=torch.float32))

    def _global_denominator(self, group: list[Micro]) -> float:
        """Token (or sequence) count of the whole mini-batch over all ranks."""
        import torch.distributed as dist
        local = 0.0
        for mb in group:
            if mb.weight == 0:
                continue
            local += loss_count(mb, self.algo.loss_agg)
        t = torch.tensor([local], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return max(float(t.item()), 1.0)

    # ---- weights -------------------------------------------------------------------------
    def sync_plan(self):
        return self.sender.plan()

    def sync_address(self) -> tuple[str, int]:
        """Where the weight group's store listens: this node's address and a free port."""
        from rl.cluster.groups import free_port, node_ip
        return node_ip(), free_port()

    def init_weight_sync(self, host: str, port: int, world_size: int,
                         backend: str | None = None) -> None:
        self.sender.connect(host, port, world_size, backend)

    def close_weight_sync(self) -> None:
        self.sender.close()

    def send_weights(self, version: int) -> dict:
        return self.sender.send(version)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights on CPU (collective under ZeRO-3); for tests and exports."""
        return self.sender.gather_all()

    # ---- checkpoint ----------------------------------------------------------------------
    def save(self, path: str, tag: str, client_state: dict | None = None,
             checksum: bool = True) -> dict:
        """Collective: every rank writes its DeepSpeed shard and its own RNG file into path/tag,
        then fsyncs the files it wrote (and their directories) and, with `checksum`, hashes them
        (`rl.checkpoint_files.seal_files`; all ranks at once). Returns {"files": {path relative
        to `path`: {"bytes", "sha256"}}, "seconds": the time sealing them took}.

        A rank that fails (a full disk) fails the save on every rank: it still meets the others
        at the barrier that ends DeepSpeed's `save_checkpoint`, then all ranks agree (an
        all-reduce) and raise, so that none is left waiting in a collective or writing into a
        directory the driver is about to remove."""
        import torch.distributed as dist
        state = dict(client_state or {})
        state["optimizer_steps"] = self.optimizer_steps
        state["lr_horizon"] = self.lr_horizon
        rng = rng_state()  # taken first: nothing the save does may shift what a resume restores
        self.engine.checkpoint_engine.take()  # forget the paths of any earlier save
        error: Exception | None = None
        try:
            self.engine.save_checkpoint(path, tag=tag, client_state=state, save_latest=False)
        except Exception as e:  # noqa: BLE001 - re-raised below, after the ranks agree
            error = e
            release_files(e)  # else the half-written shard keeps its disk space
            dist.barrier()  # the one the other ranks wait in at the end of save_checkpoint
        out: dict = {}
        if error is None:
            try:
                own = self._save_own_files(path, tag, rng)
                swap_rank = (self.engine.local_rank if self.engine.use_node_local_storage()
                             else self.engine.global_rank)
                files = rank_files(path, tag, self.engine.checkpoint_engine.take(), own,
                                   self.rank, swap_rank)
                records, seconds = seal_files(Path(path), files, checksum)
                out = {"files": records, "seconds": seconds}
            except Exception as e:  # noqa: BLE001 - re-raised below, after the ranks agree
                error = e
                release_files(e)
        failed = torch.tensor([0.0 if error is None else 1.0], device=self.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if error is not None:
            raise error
        if failed.item():
            raise PeerSaveFailed(f"trainer rank {self.rank}: the checkpoint write failed on "
                                 "another rank")
        return out

    def _save_own_files(self, path: str, tag: str, rng: dict) -> list[Path]:
        """The files this rank writes besides DeepSpeed's; returns their paths."""
        own = []
        if self.ep is not None:  # the expert shards live outside DeepSpeed: a file per rank
            own.append(rank_file(path, tag, "experts", self.rank))
            torch.save(self.ep.state_dict(), own[-1])
        # Under ZeRO 0-2 DeepSpeed writes client_state from rank 0 only, and every rank loads that
        # copy back: each rank's own streams go in a file of its own.
        own.append(rank_file(path, tag, "rng", self.rank))
        own[-1].parent.mkdir(parents=True, exist_ok=True)
        torch.save(rng, own[-1])
        return own

    def sha256(self, path: str, relpaths: list[str]) -> dict[str, str]:
        """SHA-256 of files of a checkpoint (relative to `path`), for the resume's check."""
        return sha256_files(Path(path), relpaths)

    def load(self, path: str, tag: str) -> dict:
        _, client = self.engine.load_checkpoint(path, tag=tag, load_optimizer_states=True,
                                                load_lr_scheduler_states=True)
        if client is None:
            raise RuntimeError(f"could not load trainer checkpoint {Path(path) / tag}")
        if self.ep is not None:
            f = rank_file(path, tag, "experts", self.rank)
            if not f.is_file():
                raise RuntimeError(f"trainer checkpoint {Path(path) / tag} has no expert shard "
                                   f"for rank {self.rank} ({f.name}): was it written without "
                                   "expert parallelism?")
            self.ep.load_state_dict(safe_load.load(f), f)
        rng_file = rank_file(path, tag, "rng", self.rank)
        if rng_file.is_file():
            set_rng_state(safe_load.load(rng_file))
        elif "rng" in client:
            # Checkpoints written before the per-rank files kept one copy in client_state: each
            # rank's own under ZeRO-3, rank 0's for every rank under ZeRO 0-2.
            logging.getLogger(__name__).warning(
                "%s is missing: restoring the RNG state stored with the DeepSpeed checkpoint "
                "(rank 0's under ZeRO stages 0-2)", rng_file)
            set_rng_state(client["rng"])
        else:
            raise RuntimeError(f"trainer checkpoint {Path(path) / tag} has no RNG state for rank "
                               f"{self.rank} ({rng_file.name} is missing): was it written by "
                               "fewer ranks?")
        self.optimizer_steps = client["optimizer_steps"]
        self._keep_lr_horizon(client.get("lr_horizon"))
        return client

    def _keep_lr_horizon(self, saved: int | None) -> None:
        """The LR schedule of the run's start (LambdaLR's state has its step count, not its
        function, so a resume would otherwise decay over the new num_steps: resumed at step 200
        of 250 with num_steps 500, a cosine rate jumped from 0.21 to 0.74 of lr)."""
        log = logging.getLogger(__name__)
        if saved is None:  # written before the horizon was kept
            if self.cfg.lr_schedule != "constant" and self.rank == 0:
                log.warning("the checkpoint has no LR-schedule horizon (an older version wrote "
                            "it): the schedule decays over the current %d optimizer steps",
                            self.lr_horizon)
            return
        if saved != self.lr_horizon:
            if self.rank == 0 and self.cfg.lr_schedule != "constant":
                log.warning("keeping the LR schedule's horizon of %d optimizer steps from the "
                            "run's start (num_steps now gives %d): past it the rate stays at "
                            "min_lr_ratio x lr", saved, self.lr_horizon)
            sched = self.engine.lr_scheduler
            sched.lr_lambdas = [_lr_lambda(self.cfg, saved) for _ in sched.lr_lambdas]
            self.lr_horizon = saved

    def lr_factor(self, step: int) -> float:
        """The schedule's factor of `trainer.lr` at optimizer step `step` (tests, tools)."""
        return self.engine.lr_scheduler.lr_lambdas[0](step)

    def get_rng_state(self) -> dict:
        """This rank's RNG streams, as `save` stores them (for tests)."""
        return rng_state()

    def ping(self) -> int:
        return self.rank

    def kernels(self) -> dict[str, str | None]:
        """{"attention", "experts", "lm_head"}: the implementations the actor's forward runs
        (`lm_head`: `chunked`, rl.trainer.lm_head, or `full` logits)."""
        from rl.trainer.lm_head import LogprobHead
        module = self.engine.module
        config = module.config
        head = module.get_output_embeddings()
        return {"attention": config._attn_implementation,
                "experts": getattr(config, "_experts_implementation", None),
                "lm_head": "chunked" if isinstance(head, LogprobHead) else "full"}

    def shutdown(self) -> None:
        self.sender.close()


def rank_file(path: str, tag: str, kind: str, rank: int) -> Path:
    """Where rank `rank` keeps its own `kind` of state inside the DeepSpeed checkpoint path/tag:
    `rng` (its RNG streams), `experts` (its expert shards and their AdamW state)."""
    return Path(path) / tag / f"{kind}_rank_{rank:05d}.pt"


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def buffers_to(module: torch.nn.Module, device: torch.device) -> None:
    """Moves every buffer of `module` to `device`. ZeRO-3 places the parameters of a model loaded
    on the host, not its buffers; one left there (V4's router `e_score_correction_bias`, its
    hash router's `tid2eid`) then meets activations on the GPU ("found at least two devices",
    seen on an H200). ZeRO-1/2 move the whole module, so this is a no-op for them."""
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and buf.device != device:
                sub._buffers[name] = buf.to(device)

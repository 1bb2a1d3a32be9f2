"""Per-GPU and per-node memory of the trainer group and the rollout group.

Trainer (DeepSpeed, bf16 mixed precision, AdamW), per parameter and rank, with N ranks:

| state                      | ZeRO-0 | ZeRO-1 | ZeRO-2 | ZeRO-3 | optimizer offload (>= 1)  |
| bf16 parameters            | 2      | 2      | 2      | 2/N    | (ZeRO-3 param offload: host) |
| bf16 gradients             | 2      | 2      | 2/N    | 2/N    | ZeRO-3: 2/N on host        |
| fp32 master, Adam m and v  | 12     | 12/N   | 12/N   | 12/N   | host or NVMe               |
| fp32 gradient copy (step)  | 4      | 4/N    | 4/N    | 4/N, at most 4 GB at once | host or NVMe |

(DeepSpeed 0.19 `stage3.py` / `stage_1_and_2.py`: the optimizer consumes an fp32 gradient
partition; with offload, ZeRO-3 keeps the bf16 gradient partition in pinned host memory too.)
fp32 training (CPU runs): 4 + 4 + 8 bytes, no master copy. Add the transient buffers: ZeRO-3
gathers a whole module (an MoE layer's expert stack) plus its gradient before reduce-scatter;
stages 1-2 keep reduce / all-gather buckets (5e8 elements each, DeepSpeed's defaults).

Rollout (vLLM), per GPU: weights / TP (replicated parts in full), then what is left of
`gpu_memory_utilization x GPU` after weights and overhead is KV cache.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from rl.config import Config
from rl.models.attention import EAGER_ONLY, attention_kernel
from rl.plan import activations
from rl.plan.arch import Arch, fp8_bytes, fp8_eligible
from rl.plan.kv import KV_FP8_SCALE_BYTES, KVLayout, kv_layout, native_fp8_slots

GiB = 2**30
BUCKET_ELEMS = 5e8            # DeepSpeed reduce_bucket_size / allgather_bucket_size defaults
PREFETCH_ELEMS = 5e7          # stage3_prefetch_bucket_size default
SUB_GROUP_ELEMS = 1e9         # sub_group_size default: the optimizer steps this many at a time
SWAP_BUFFERS = 4              # ZeRO-Infinity optimizer swap buffers per rank (buffer_count)


def size(nbytes: float) -> str:
    """Human units: `33.1 GiB`, `1.2 TiB`, `512.0 MiB`."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes / 2**10:,.1f} KiB"


@dataclass(slots=True)
class Line:
    """One row of a memory table. `gpu` is bytes per GPU, `host` / `nvme` bytes per node.
    `phase`: `always` (resident), `train` (forward/backward peak) or `step` (optimizer step);
    the peak is always + max(train, step)."""
    label: str
    gpu: float = 0.0
    host: float = 0.0
    nvme: float = 0.0
    phase: str = "always"


@dataclass(slots=True)
class GroupPlan:
    name: str
    header: list[str]
    lines: list[Line]
    gpu_budget: float | None
    """Bytes per GPU the group may use (None: runs on CPU)."""
    host_budget: float | None = None
    nvme_budget: float | None = None
    problems: list[str] = field(default_factory=list)
    """Reasons the group cannot run besides the budget checks (bad combinations)."""
    notes: list[str] = field(default_factory=list)
    kv: KVLayout | None = None
    concurrent: int = 0
    """Rollout: sequences of max_model_len the KV cache holds at once (per engine)."""

    def need(self, where: str) -> float:
        peak = {"always": 0.0, "train": 0.0, "step": 0.0}
        for ln in self.lines:
            peak[ln.phase] += getattr(ln, where)
        return peak["always"] + max(peak["train"], peak["step"])

    def overruns(self) -> list[str]:
        out = []
        for where, budget, unit in (("gpu", self.gpu_budget, "per GPU"),
                                    ("host", self.host_budget, "host RAM per node"),
                                    ("nvme", self.nvme_budget, "NVMe per node")):
            need = self.need(where)
            if budget is not None and need > budget:
                out.append(f"{unit}: needs {size(need)} of {size(budget)} "
                           f"(over by {size(need - budget)})")
        return out

    @property
    def fits(self) -> bool:
        return not self.problems and not self.overruns()


def sequence_length(cfg: Config) -> int:
    """Longest sequence (prompt + response) the trainer sees."""
    return min(cfg.rollout.max_model_len, cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens)


def _largest_dense_module(arch: Arch) -> int:
    """The largest module ZeRO-3 gathers when the routed experts are expert-parallel."""
    def compute() -> int:
        sizes: dict[str, int] = {}
        for x in arch.tensors:
            if not x.routed:
                sizes[x.module] = sizes.get(x.module, 0) + x.numel
        return max(sizes.values())
    return arch.memoised("largest_dense_module", compute)


@dataclass(frozen=True, slots=True)
class _Ranks:
    """The trainer group's shape, as `plan_trainer`'s rows use it."""
    n: int                # trainer ranks
    stage: int            # ZeRO stage
    ep: int               # expert-parallel size
    routed: int           # routed-expert parameters kept out of ZeRO (0 without EP)
    P: int                # parameters ZeRO holds
    w: int                # parameter / gradient bytes
    bf16: bool
    on_gpu: bool
    nodes: int
    per_node: int         # ranks per node
    opt_dev: str          # trainer.optimizer_offload
    par_dev: str          # trainer.param_offload

    @classmethod
    def of(cls, cfg: Config, arch: Arch) -> _Ranks:
        t, cl = cfg.trainer, cfg.cluster.trainer
        ep = t.expert_parallel_size
        # Expert parallelism (rl.trainer.expert_parallel) keeps the routed experts out of ZeRO:
        # P is what ZeRO holds, the routed stacks are counted 1/EP per rank (_expert_lines).
        routed = sum(x.numel for x in arch.tensors if x.routed) if ep > 1 else 0
        n = t.num_ranks
        on_gpu = cl.gpus_per_node > 0
        nodes = cfg.cluster.num_nodes("trainer")  # a local run puts every rank on this machine
        bf16 = cfg.model.dtype == "bfloat16"
        return cls(n=n, stage=t.zero_stage, ep=ep, routed=routed, P=arch.total_params - routed,
                   w=2 if bf16 else 4, bf16=bf16, on_gpu=on_gpu, nodes=nodes,
                   per_node=cl.gpus_per_node if on_gpu else math.ceil(n / nodes),
                   opt_dev=t.optimizer_offload, par_dev=t.param_offload)

    def part(self, nbytes: float, partitioned: bool) -> float:
        return nbytes / self.n if partitioned else nbytes

    def place(self, label: str, per_rank: float, device: str, phase: str = "always") -> Line:
        if device == "gpu":
            return Line(label, gpu=per_rank, phase=phase)
        key = "host" if device == "cpu" else "nvme"
        return Line(label, phase=phase, **{key: per_rank * self.per_node})


def _trainer_problems(cfg: Config, arch: Arch, r: _Ranks) -> list[str]:
    """Combinations the trainer cannot run, whatever the memory."""
    cl, ep = cfg.cluster.trainer, r.ep
    problems: list[str] = []
    if r.opt_dev != "none" and r.stage == 0:
        problems.append("trainer.optimizer_offload needs trainer.zero_stage >= 1 (DeepSpeed "
                        "offloads ZeRO partitions)")
    if r.par_dev != "none" and r.stage != 3:
        problems.append("trainer.param_offload needs trainer.zero_stage: 3")
    if ep > 1 and (not arch.num_experts or arch.num_experts % ep):
        problems.append(f"trainer.expert_parallel_size {ep} does not divide the model's "
                        f"{arch.num_experts} routed experts")
    if r.on_gpu and cfg.cluster.kind != "local" and r.n != cl.nodes * cl.gpus_per_node:
        problems.append(f"trainer.num_ranks is {r.n} but cluster.trainer has {cl.nodes} x "
                        f"{cl.gpus_per_node} = {cl.nodes * cl.gpus_per_node} GPUs")
    return problems


def _state_lines(r: _Ranks) -> list[Line]:
    """Parameters, gradients and optimizer state of what ZeRO holds."""
    n, stage, P, w, bf16, opt_dev, place = r.n, r.stage, r.P, r.w, r.bf16, r.opt_dev, r.place
    lines = [place(f"parameters ({'bf16' if bf16 else 'fp32'}{', 1/%d' % n if stage == 3 else ''})",
                   r.part(w * P, stage == 3), "cpu" if r.par_dev == "cpu" else "gpu")]
    grads_partitioned = stage >= 2
    if opt_dev != "none" and stage >= 2:
        if stage == 3:  # the reduce-scattered bf16 partition is kept in pinned host memory
            lines.append(place(f"gradients ({'bf16' if bf16 else 'fp32'}, 1/{n}, offloaded)",
                               r.part(w * P, True), "cpu"))
    else:
        lines.append(place(f"gradients ({'bf16' if bf16 else 'fp32'}"
                           f"{', 1/%d' % n if grads_partitioned else ''})",
                           r.part(w * P, grads_partitioned), "gpu"))
    # ZeRO-2/3 with offload: the GPU keeps only the reduce bucket (_buffer_lines); ZeRO-3 also
    # keeps the bf16 partition in pinned host memory (above), ZeRO-2 reduces straight into the
    # fp32 copy.
    opt_where = {"none": "gpu", "cpu": "cpu", "nvme": "nvme"}[opt_dev]
    if bf16 or stage >= 1:  # ZeRO partitions always get an fp32 copy, even of fp32 parameters
        lines.append(place(f"fp32 master weights{' (1/%d)' % n if stage else ''}",
                           r.part(4 * P, stage >= 1), opt_where))
    lines.append(place(f"AdamW moments m, v (fp32){' (1/%d)' % n if stage else ''}",
                       r.part(8 * P, stage >= 1), opt_where))
    if bf16:
        fp32_grad = r.part(4 * P, stage >= 1)
        if opt_dev == "none":
            if stage == 3:  # stepped one sub-group at a time
                fp32_grad = min(fp32_grad, 4 * SUB_GROUP_ELEMS)
            lines.append(place("fp32 gradient copy (optimizer step)", fp32_grad, "gpu", "step"))
        else:
            lines.append(place("fp32 gradients (offloaded)", fp32_grad, opt_where))
    return lines


def _expert_lines(arch: Arch, r: _Ranks) -> list[Line]:
    """The routed experts under expert parallelism (none without it)."""
    ep, routed, w, bf16, opt_dev, place = r.ep, r.routed, r.w, r.bf16, r.opt_dev, r.place
    if ep > 1 and opt_dev == "none":  # weights, gradients, fp32 master (bf16 only), AdamW m, v
        return [place(f"routed experts (1/{ep}, expert parallel): weights, gradients, "
                      "optimizer", routed / ep * (2 * w + (4 if bf16 else 0) + 8), "gpu")]
    if ep <= 1:
        return []
    # offloaded (nvme too): rl.trainer.expert_parallel keeps the state in host RAM
    lines = [place(f"routed experts (1/{ep}, expert parallel): weights, gradients",
                   routed / ep * 2 * w, "gpu"),
             place(f"routed experts (1/{ep}): fp32 master, AdamW m, v (host RAM"
                   f"{', not NVMe' if opt_dev == 'nvme' else ''})", routed / ep * 12, "cpu")]
    # Stepped one tensor at a time: one fp32 gradient buffer (and a bf16 staging one) of
    # the largest shard.
    largest = max((x.numel for x in arch.tensors if x.routed), default=0) / ep
    lines.append(place("routed experts: fp32 gradient of one tensor (CPU AdamW step)",
                       largest * (4 + (w if bf16 else 0)), "cpu"))
    return lines


def _buffer_lines(cfg: Config, arch: Arch, r: _Ranks) -> list[Line]:
    """Swap buffers, ZeRO buckets and gathers, and the reference model."""
    lines = []
    if r.opt_dev == "nvme":
        swap = SWAP_BUFFERS * min(SUB_GROUP_ELEMS, r.P / r.n) * 4
        lines.append(r.place("NVMe swap buffers (pinned)", swap, "cpu"))
    if r.on_gpu and r.stage >= 1:  # allocated at engine init (CPU pages stay untouched: skipped)
        lines.append(r.place("ZeRO reduce bucket (5e8 elements)", r.w * BUCKET_ELEMS, "gpu"))
    if r.stage == 3:
        largest = arch.largest_module() if r.ep == 1 else _largest_dense_module(arch)
        gathered = 2 * r.w * (largest + min(PREFETCH_ELEMS, r.P))
        lines.append(r.place("ZeRO-3 gathered largest module + its gradient", gathered, "gpu",
                             "train"))
    if cfg.algorithm.kl_coef > 0:
        lines.append(r.place("reference model (kl_coef > 0; full copy, not partitioned)",
                             r.w * r.P, "gpu"))
    return lines


def _activation_lines(cfg: Config, arch: Arch, r: _Ranks, tokens: int, seq: int,
                      eager: bool) -> list[Line]:
    """Forward/backward activations of one micro-batch of `tokens`, then the CUDA overhead."""
    t = cfg.trainer
    rows = t.lm_head_chunk_rows if t.chunked_lm_head else 0
    act = activations.estimate(arch, tokens, seq, t.activation_checkpointing, eager,
                               cfg.algorithm.entropy_coef > 0, elem_bytes=r.w,
                               head_chunk_rows=rows)
    ckpt = "checkpointed" if t.activation_checkpointing else "no checkpointing"
    head = (f"activations: LM head, chunked ({min(rows, tokens):,} rows of logits at a time)"
            if rows else "activations: logits + log-prob fp32 chunks")
    lines = [r.place(f"activations: decoder layers ({ckpt})", act.layers, "gpu", "train"),
             r.place(head, act.logits, "gpu", "train")]
    if eager:
        lines.append(r.place(f"activations: eager attention scores (S={seq:,})",
                             act.eager_scores, "gpu", "train"))
    if r.on_gpu:
        lines.append(r.place("CUDA context, NCCL, allocator slack (plan.overhead_gb)",
                             cfg.plan.overhead_gb * GiB, "gpu"))
    return lines


def _trainer_header(cfg: Config, r: _Ranks, tokens: int, seq: int) -> list[str]:
    return [
        f"{r.nodes} node(s) x {r.per_node} rank(s) = {r.n} ranks"
        + ("" if r.on_gpu else " (CPU: no GPU budget; host memory holds everything)"),
        f"DeepSpeed ZeRO-{r.stage}, {'bf16 mixed precision' if r.bf16 else 'fp32'} + AdamW, "
        f"optimizer offload: {r.opt_dev}, param offload: {r.par_dev}, activation checkpointing: "
        f"{'on' if cfg.trainer.activation_checkpointing else 'off'}",
        f"micro-batch: {tokens:,} tokens (sequences up to {seq:,} = min(max_model_len, "
        f"{cfg.data.max_prompt_tokens:,} prompt + {cfg.rollout.max_new_tokens:,} new))",
    ]


def _trainer_notes(arch: Arch, r: _Ranks, eager: bool) -> list[str]:
    notes = []
    if eager:
        notes.append(f"attention: transformers' eager {arch.model_type} attention "
                     "(trainer.attention_kernel=eager); auto runs rl.models.v4_attention, O(S) memory")
    elif arch.model_type in EAGER_ONLY:
        notes.append("attention: rl.models.v4_attention, O(S) memory, the trainer's default for "
                     f"{arch.model_type} (measured: bench/results/v4_attention.md)")
    if r.ep > 1 and r.opt_dev == "nvme":
        notes.append("expert parallelism: the routed experts' fp32 master weights and AdamW "
                     "moments go to host RAM, not NVMe (rl.trainer.expert_parallel steps them "
                     "on the CPU; DeepSpeed's NVMe swapper serves only its own ZeRO state)")
    return notes


def plan_trainer(cfg: Config, arch: Arch) -> GroupPlan:
    """The trainer group's memory table: ZeRO state, expert shards, buffers, activations."""
    t, p, cl = cfg.trainer, cfg.plan, cfg.cluster.trainer
    r = _Ranks.of(cfg, arch)
    problems = _trainer_problems(cfg, arch, r)
    lines = _state_lines(r) + _expert_lines(arch, r) + _buffer_lines(cfg, arch, r)
    seq = sequence_length(cfg)
    tokens = max(t.micro_batch_tokens, seq)
    # The rule load_model applies, so the plan counts the attention the trainer really runs.
    eager = attention_kernel(arch.model_type, t.attention_kernel) == "eager"
    lines += _activation_lines(cfg, arch, r, tokens, seq, eager)

    host_budget = p.host_memory_gb * GiB
    if cl.mem_gb > 0:
        host_budget = min(host_budget, cl.mem_gb * GiB)
    header = _trainer_header(cfg, r, tokens, seq)
    notes = _trainer_notes(arch, r, eager)
    if not r.on_gpu:  # CPU run: everything sits in host memory of the one machine
        for ln in lines:
            ln.host, ln.gpu = ln.host + ln.gpu * r.per_node, 0.0
    return GroupPlan("trainer", header, lines, p.gpu_memory_gb * GiB if r.on_gpu else None,
                     host_budget, p.nvme_gb * GiB if r.opt_dev == "nvme" else None,
                     problems, notes)


def rollout_weight_bytes(arch: Arch, tp: int, fp8: bool) -> tuple[float, float, float]:
    """(total, kept-in-BF16, FP8 block scales) weight bytes on one TP rank."""
    key = ("rollout_weight_bytes", tp, fp8)
    if key not in arch.memo:
        arch.memo[key] = _weight_bytes(arch, tp, fp8)
    return arch.memo[key]


def _weight_bytes(arch: Arch, tp: int, fp8: bool) -> tuple[float, float, float]:
    total = kept = scales = 0.0
    for t in arch.tensors:
        split = min(tp, t.tp_shards or tp)
        if fp8 and fp8_eligible(t.name, t.shape, arch.model_type):
            b = fp8_bytes(t.shape)
            scales += (b - t.numel) / split
        else:
            b = 2 * t.numel
            kept += b / split
        total += b / split
    return total, kept, scales


def plan_rollout(cfg: Config, arch: Arch) -> GroupPlan:
    r, p, cl = cfg.rollout, cfg.plan, cfg.cluster.rollout
    tp, fp8 = r.tensor_parallel_size, r.quantization == "fp8"
    on_gpu = cl.gpus_per_node > 0
    weights, kept, scales = rollout_weight_bytes(arch, tp, fp8)
    other = rollout_weight_bytes(arch, tp, not fp8)[0]
    fp8_kv = r.kv_cache_dtype in ("fp8", "fp8_ds_mla")
    kv = kv_layout(arch, tp, 1 if fp8_kv else 2, cache_dtype=r.kv_cache_dtype if on_gpu else None,
                   scale_bytes=KV_FP8_SCALE_BYTES if fp8_kv and r.engine == "native" else 0)
    problems: list[str] = []
    if on_gpu:
        budget = r.gpu_memory_utilization * p.gpu_memory_gb * GiB
        overhead = p.overhead_gb * GiB
        gpus = cl.nodes * cl.gpus_per_node
        if cfg.cluster.kind == "slurm" and r.num_engines * tp > gpus:
            problems.append(f"rollout.num_engines x tensor_parallel_size = {r.num_engines * tp} GPUs "
                            f"but cluster.rollout has {cl.nodes} x {cl.gpus_per_node} = {gpus}")
    else:  # vLLM-CPU: weights in RAM, the KV cache is a fixed `cpu_kvcache_gb`
        budget, overhead = None, 0.0
    room = (budget - weights - overhead) if on_gpu else r.cpu_kvcache_gb * GiB  # type: ignore[operator]  # lint baseline (issue 39)
    # the native engine's FP8 cache pads each row to whole attention tiles
    native_fp8 = fp8_kv and r.engine == "native"
    seq_bytes = kv.sequence_bytes(native_fp8_slots(r.max_model_len) if native_fp8
                                  else r.max_model_len)
    concurrent = max(int(room // seq_bytes), 0) if room > 0 else 0
    fmt = "FP8" if fp8 else "BF16"
    lines = [Line(f"weights ({fmt}, TP {tp})", gpu=weights if on_gpu else 0.0,
                  host=0.0 if on_gpu else weights)]
    if on_gpu:
        lines.append(Line("vLLM activations, CUDA graphs, NCCL (plan.overhead_gb)", gpu=overhead))
        lines.append(Line("KV cache (what is left of gpu_memory_utilization)", gpu=max(room, 0.0)))
    header = [
        (f"{cl.nodes} node(s) x {cl.gpus_per_node} GPUs, " if on_gpu else "CPU, ")
        + f"{r.num_engines} engine(s) x TP {tp}, {r.engine} {fmt}"
        + (f", gpu_memory_utilization {r.gpu_memory_utilization} x {p.gpu_memory_gb:g} GiB = "
           f"{size(budget)}" if on_gpu else f", cpu_kvcache_gb {r.cpu_kvcache_gb:g}"),  # type: ignore[arg-type]  # lint baseline (issue 39)
        f"weights per {'GPU' if on_gpu else 'engine'}: {fmt} {size(weights)} vs "
        f"{'BF16' if fp8 else 'FP8'} {size(other)}"
        + (f" (FP8 frees {size(other - weights)} for KV cache)" if fp8
           else f" (FP8 would free {size(weights - other)})"),
    ]
    if fp8:
        header.append(f"  kept in BF16 (embeddings, lm_head, norms, routers, 1-D): {size(kept)}; "
                      f"FP8 block scales (128x128, fp32): {size(scales)}")
    header += list(kv.explain)
    if room <= 0:
        problems.append(f"weights {size(weights)} + overhead {size(overhead)} exceed "
                        f"gpu_memory_utilization x GPU = {size(budget)}: no room for KV cache")  # type: ignore[arg-type]  # lint baseline (issue 39)
    elif concurrent < 1:
        problems.append(f"KV cache room {size(room)} cannot hold one sequence of max_model_len "
                        f"{r.max_model_len:,} ({size(seq_bytes)}): vLLM refuses to start")
    notes = []
    if room > 0:
        batch = cfg.algorithm.prompts_per_step * r.n_samples
        per_engine = math.ceil(batch / r.num_engines)
        waves = math.ceil(per_engine / concurrent) if concurrent else 0
        notes.append(f"KV room {size(room)} = {room / kv.per_token:,.0f} tokens "
                     f"({size(seq_bytes)} per {r.max_model_len:,}-token sequence): "
                     f"{concurrent:,} concurrent sequences at full context per engine")
        if on_gpu and fp8:
            alt_room = budget - other - overhead  # type: ignore[operator]  # lint baseline (issue 39)
            alt = max(int(alt_room // seq_bytes), 0) if alt_room > 0 else 0
            notes.append(f"with BF16 weights: KV room {size(max(alt_room, 0))}, "
                         f"{alt:,} concurrent sequences")
        if concurrent:
            notes.append(f"a step samples {cfg.algorithm.prompts_per_step} prompts x {r.n_samples} = "
                         f"{batch:,} sequences, {per_engine:,} per engine: {waves} wave(s) at full "
                         "context" + ("" if waves <= 1 else " (shorter responses pack more)"))
    # The budget shown is the whole GPU; vLLM takes gpu_memory_utilization of it (the KV cache
    # fills whatever weights and overhead leave), so the rollout always "uses" exactly that.
    return GroupPlan("rollout", header, lines, p.gpu_memory_gb * GiB if on_gpu else None,
                     problems=problems, notes=notes, kv=kv, concurrent=concurrent)


def line_gpu(g: GroupPlan, prefix: str) -> float:
    """Per-GPU bytes of the first line whose label starts with `prefix` (for reports, tests)."""
    return next(ln.gpu for ln in g.lines if ln.label.startswith(prefix))

"""Step-time estimate: how long one RL step takes, from measured rates and stated bandwidths.

Each component is bytes or FLOPs over a rate (units: seconds, bytes, FLOP, GB/s = 1e9 B/s):

- trainer compute: tokens x active matmul parameters x (2 old-log-prob forward + per epoch 6
  forward/backward + 2 recompute with activation checkpointing) / (matmul rate x mfu),
  plus causal attention FLOPs; DeepSeek-V4 attention at the rates measured for
  rl.models.v4_attention per layer kind (bench/results/v4_attention_h100*.json: CSA, HCA,
  sliding-only), not by FLOPs (that kernel runs far from the matmul peak);
- trainer collectives per rank: ZeRO-3 all-gathers (old-log-prob forward, forward, recompute,
  backward) and the gradient reduce-scatter per micro-batch; ZeRO-1/2 gradient reduction per
  micro-batch plus a parameter all-gather per optimizer step; ring volume (n - 1) / n over the
  per-GPU link (inter-node when the group spans nodes); expert parallelism's dispatch + combine
  every pass (a token once per rank owning one of its picks, once per node first when the EP
  group spans nodes; expected rows under uniform routing, `ep_hops`), node-local rows over
  NVLink / xGMI and the rest over the inter-node link, and the experts' gradient all-reduce per
  optimizer step;
- weight sync: the wire bytes (FP8 with `sync.wire_dtype: fp8`) broadcast from trainer rank 0,
  over the link x sync_efficiency, plus ZeRO-3's gather of the full weights onto rank 0;
- rollout, per engine: prefill at max(FLOPs / (matmul rate x mfu), weight bytes / HBM), then
  every decode step streams the weights of one TP rank and every row's KV context over HBM, plus
  decode_step_overhead_ms; waves when the KV cache holds fewer rows than the engine's share;
- the step: on-policy rollout + train + sync; with max_staleness >= 1 the next rollout overlaps
  training: max(rollout, train + sync).

Upper bound on lengths: every response runs to max_new_tokens. Not modelled: the optimizer step
(on GPU it is bytes of fp32 state over HBM, small; offloaded to CPU / NVMe it is not), reward
scoring, evaluation, checkpoints. Validation against the 2 x H200 measurements:
`python -m bench.plan_time` (bench/results/plan_time.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from rl.config import Config
from rl.models.attention import EAGER_ONLY, attention_kernel
from rl.plan.arch import Arch
from rl.plan.memory import GroupPlan, rollout_weight_bytes, sequence_length

GB = 1e9


@dataclass(frozen=True, slots=True)
class Device:
    """Rates of one GPU and its links. `source` says where each number comes from."""
    name: str
    matmul_tflops: float
    hbm_gbps: float
    intra_node_gbps: float
    inter_node_gbps: float
    v4_attention_us_per_token: dict[str, float] | None
    """One V4 attention layer of each kind (`compressed_sparse_attention`,
    `heavily_compressed_attention`, `sliding_attention`; projections included), forward +
    backward, microseconds per token at 18,432 tokens (V4-Flash's micro-batch); None: not
    measured on this device (scaled from H200 by matmul rate)."""
    source: str


# H200: measured on 2 x H200 (NVLink) in bench/results (train.json bf16 peak 791, rollout.json
# copy 4,144 GB/s, weight_sync.json flat NCCL broadcast 368 GB/s); the V4 attention rates are
# one layer with the Triton forward and backward at 18,432 tokens on an H100 (the H200's
# compute; the kernel is bound by compute and latency, not HBM), with the Triton indexer, the
# two-pass backward and the compiled query / output chains: CSA 79.2 ms
# (v4_attention_h100_csa.json), HCA 42.7 ms (v4_attention_h100_hca.json), sliding-only 37.3 ms
# (v4_attention_h100_sliding.json);
# IB is the DGX H200 datasheet's one 400 Gb/s ConnectX-7 per GPU.
# MI300X: AMD datasheet (1,307 TFLOP/s dense BF16, 5.3 TB/s HBM3, 7 x 64 GB/s Infinity Fabric
# links per GPU = 448 GB/s), 400 Gb/s NIC per GPU; nothing measured here.
DEVICES = {
    "h200": Device("h200", 791.0, 4144.0, 368.0, 50.0,
                   {"compressed_sparse_attention": 79.2e3 / 18432,
                    "heavily_compressed_attention": 42.7e3 / 18432,
                    "sliding_attention": 37.3e3 / 18432},
                   "measured in bench/results (train, rollout, weight_sync, v4_attention_h100*); "
                   "inter-node: DGX H200 datasheet"),
    "mi300x": Device("mi300x", 1307.0, 5300.0, 448.0, 50.0, None,
                     "AMD MI300X datasheet peaks, not measured; 400 Gb/s NIC per GPU"),
}


def device(cfg: Config) -> Device:
    """The preset `plan.device` with the config's overrides applied."""
    p, d = cfg.plan, DEVICES[cfg.plan.device]
    over = {k: getattr(p, k) for k in ("matmul_tflops", "hbm_gbps", "intra_node_gbps",
                                      "inter_node_gbps") if getattr(p, k) is not None}
    if not over:
        return d
    return replace(d, **over, source=d.source + "; overridden: " + ", ".join(sorted(over)))


# ----------------------------------------------------------------------------------------------
# Components (pure functions, also used by bench.plan_time)
# ----------------------------------------------------------------------------------------------
def _attention_params(arch: Arch) -> int:
    return arch.memoised("attention_params", lambda: sum(
        t.numel for t in arch.tensors if ".self_attn." in t.name))


def attention_flops_per_token(arch: Arch, seq: int) -> float:
    """Forward FLOPs of causal attention scores + weighted values per token (all layers), at
    average context seq / 2; V4 returns 0 (its attention is timed by its measured rate)."""
    c = arch.config
    if arch.model_type in EAGER_ONLY:
        return 0.0
    heads = c.get("num_attention_heads", 0)
    if arch.model_type == "deepseek_v3":
        qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        return 2 * (seq / 2) * heads * (qk + c["v_head_dim"]) * arch.num_layers
    hd = c.get("head_dim") or arch.hidden // heads
    return 4 * (seq / 2) * heads * hd * arch.num_layers


def matmul_params(arch: Arch) -> float:
    """Active parameters a token multiplies by, without V4's attention modules (timed apart)."""
    # active_params leaves out the input embedding (a lookup); a tied LM head still multiplies
    tied = arch.input_embedding_params if arch.config.get("tie_word_embeddings") else 0
    if arch.model_type in EAGER_ONLY:
        return arch.active_params + tied - _attention_params(arch)
    return arch.active_params + tied


def v4_attention_us_per_token(arch: Arch, dev: Device) -> float:
    """Microseconds per token of one forward + backward through all of V4's attention layers,
    each at its kind's measured rate (a device without rates: the H200's, scaled by matmul
    rate)."""
    rates, scale = dev.v4_attention_us_per_token, 1.0
    if rates is None:
        rates = DEVICES["h200"].v4_attention_us_per_token
        scale = DEVICES["h200"].matmul_tflops / dev.matmul_tflops
    assert rates is not None
    return sum(rates[kind] for kind in arch.layer_types) * scale


def trainer_compute_s(arch: Arch, tokens: float, seq: int, epochs: int, checkpointing: bool,
                      dev: Device, mfu: float) -> dict[str, float]:
    """Seconds of one rank's compute for `tokens` tokens of sequences of `seq` tokens.
    Returns {'matmul': s, 'attention': s}."""
    passes = 2 + epochs * (6 + (2 if checkpointing else 0))   # in units of "2 x N per token"
    matmul = tokens * matmul_params(arch) * passes / (dev.matmul_tflops * 1e12 * mfu)
    attn_fwd = attention_flops_per_token(arch, seq)
    attn = tokens * attn_fwd * (passes / 2) / (dev.matmul_tflops * 1e12 * mfu)
    if arch.model_type in EAGER_ONLY:  # measured rate: forward + backward = 3 forwards
        fwd_bwd_units = (1 + epochs * (3 + (1 if checkpointing else 0))) / 3
        attn = tokens * v4_attention_us_per_token(arch, dev) * 1e-6 * fwd_bwd_units
    return {"matmul": matmul, "attention": attn}


def ring_s(nbytes: float, ranks: int, gbps: float) -> float:
    """A ring all-gather / reduce-scatter of `nbytes` in total among `ranks`: each rank moves
    (ranks - 1) / ranks of it over its own link."""
    return 0.0 if ranks <= 1 else nbytes * (ranks - 1) / ranks / (gbps * GB)


def _p_any(experts: int, top_k: int, held: int) -> float:
    """Probability that `held` of `experts` experts hold at least one of a token's `top_k` picks
    (distinct picks, uniform routing)."""
    return 1.0 - math.comb(experts - held, top_k) / math.comb(experts, top_k)


def ep_hops(cfg: Config, arch: Arch) -> list[dict[str, float]]:
    """The expert-parallel dispatch's hops as `rl.trainer.expert_parallel` runs them (a token
    goes once to each rank owning one of its picks; with an EP group wider than a node, first
    once to each node, to the rank of the same local index, then inside the node): per hop,
    the rows a rank sends per token of its own, in expectation under uniform routing, split
    into 'local' (to itself), 'intra' (same node) and 'inter' (other nodes)."""
    ep, e, k = cfg.trainer.expert_parallel_size, arch.num_experts, arch.top_k
    node = cfg.cluster.trainer.gpus_per_node
    per_rank = _p_any(e, k, e // ep)
    if 1 < node < ep and ep % node == 0:   # two hops
        nodes = ep // node
        per_node = _p_any(e, k, e // nodes)
        return [{"local": per_node, "intra": 0.0, "inter": (nodes - 1) * per_node},
                # each of the token's nodes forwards it to the ranks there owning a pick
                {"local": nodes * per_rank, "intra": nodes * (node - 1) * per_rank,
                 "inter": 0.0}]
    inside = min(ep, node) if node else ep   # no node size given: one node
    return [{"local": per_rank, "intra": (inside - 1) * per_rank,
             "inter": (ep - inside) * per_rank}]


def collective_bytes(cfg: Config, arch: Arch, micro_batches: int, tokens_per_mb: float
                     ) -> dict[str, float]:
    """Bytes one trainer rank's collectives handle in one step, each call counted at its full
    buffer (gathered output, scattered input, all-to-all input): {'all_gather',
    'reduce_scatter', 'all_to_all', 'expert_all_reduce'}, and the all-to-all's share over the
    node's links and between nodes ('all_to_all_intra', 'all_to_all_inter'; what a rank sends
    to itself stays out of both). ZeRO-0's all-reduce counts as a reduce-scatter plus an
    all-gather."""
    t = cfg.trainer
    ep, epochs = t.expert_parallel_size, t.ppo_epochs
    ckpt = 1 if t.activation_checkpointing else 0
    w = 2 if cfg.model.dtype == "bfloat16" else 4
    routed = sum(x.numel for x in arch.tensors if x.routed) if ep > 1 else 0
    zero = w * (arch.total_params - routed)
    if t.zero_stage == 3:
        # Every micro-batch: a gather per forward (old-log-prob, train, the recompute: ZeRO-3
        # releases a module's parameters after its forward) and per backward, one reduce-scatter.
        gathers, scatters = micro_batches * (1 + epochs * (2 + ckpt)), micro_batches * epochs
    elif t.zero_stage in (1, 2):   # gradients per micro-batch, parameters per optimizer step
        gathers, scatters = t.num_mini_batches * epochs, micro_batches * epochs
    else:
        gathers = scatters = micro_batches * epochs
    out = {"all_gather": gathers * zero, "reduce_scatter": scatters * zero,
           "all_to_all": 0.0, "all_to_all_intra": 0.0, "all_to_all_inter": 0.0,
           "expert_all_reduce": 0.0}
    if ep > 1 and arch.num_experts:
        moe_layers = sum(1 for k in arch.mlp_kinds if k == "moe")
        passes = 1 + epochs * (2 + ckpt)   # forwards (old-log-prob, train, recompute), backward
        row = arch.hidden * w
        # a dispatched row also carries its picks' ids (int64) and routing weights (fp32)
        sent = {"dispatch": row + arch.top_k * (8 + 4), "combine": row}
        scale = micro_batches * passes * moe_layers * tokens_per_mb
        for hop in ep_hops(cfg, arch):
            rows = sum(hop.values())
            out["all_to_all"] += scale * rows * sum(sent.values())
            out["all_to_all_intra"] += scale * hop["intra"] * 2 * row
            out["all_to_all_inter"] += scale * hop["inter"] * 2 * row
        out["expert_all_reduce"] = t.num_mini_batches * epochs * w * routed / ep
    return out


def trainer_comm_s(cfg: Config, arch: Arch, micro_batches: int, tokens_per_mb: float,
                   dev: Device) -> dict[str, float]:
    """Seconds of one rank's collectives in one step: {'zero': s, 'all_to_all': s} (the
    latter with the experts' gradient all-reduce), `collective_bytes` over the links: the
    all-to-all's node-local rows over NVLink / xGMI, the rest over the inter-node link, one
    after the other (the second hop waits for the first)."""
    t, cl = cfg.trainer, cfg.cluster.trainer
    n, ep = t.num_ranks, t.expert_parallel_size
    b = collective_bytes(cfg, arch, micro_batches, tokens_per_mb)
    spans = cfg.cluster.num_nodes("trainer") > 1 and cl.gpus_per_node > 0
    link = dev.inter_node_gbps if spans else dev.intra_node_gbps
    zero = ring_s(b["all_gather"] + b["reduce_scatter"], n, link)
    a2a = (b["all_to_all_intra"] / (dev.intra_node_gbps * GB)
           + b["all_to_all_inter"] / (dev.inter_node_gbps * GB))
    replicas = n // ep   # an expert shard lives on n / ep ranks: ring all-reduce among them
    a2a += 2 * ring_s(b["expert_all_reduce"], replicas, link)
    return {"zero": zero, "all_to_all": a2a}


def sync_s(wire_bytes: float, gbps: float, efficiency: float) -> float:
    """One weight update: the wire bytes broadcast from trainer rank 0 at efficiency x link."""
    return wire_bytes / (gbps * GB * efficiency)


def decode_s(weight_bytes: float, kv_per_token: float, kv_per_sequence: float, rows: int,
             prompt: int, new: int, active_params: float, attn_fwd_per_token: float,
             dev: Device, mfu: float, step_overhead_s: float, tp: int = 1) -> dict[str, float]:
    """One generate call of `rows` sequences on one engine (its TP ranks in parallel):
    {'prefill': s, 'decode': s}. weight_bytes / kv_* are per TP rank; `weight_bytes` is what
    a decode step streams (without an untied input embedding, which is only indexed). The
    prefill is a forward over rows x prompt tokens at `mfu`, like the trainer's passes."""
    hbm = dev.hbm_gbps * GB
    flops = (2 * active_params + attn_fwd_per_token) * rows * prompt / tp
    prefill = max(flops / (dev.matmul_tflops * 1e12 * mfu), weight_bytes / hbm)
    steps = max(new - 1, 0)   # the first token comes out of the prefill
    ctx = rows * (steps * prompt + steps * (steps + 1) / 2)   # sum over steps of context rows
    decode = (steps * (weight_bytes + rows * kv_per_sequence) + ctx * kv_per_token) / hbm
    return {"prefill": prefill, "decode": decode + steps * step_overhead_s}


def streamed_weight_bytes(arch: Arch, tp: int, fp8: bool) -> float:
    """Bytes of weights one decode step reads on one TP rank (the input embedding is indexed,
    not read, unless it is tied to the LM head)."""
    total = rollout_weight_bytes(arch, tp, fp8)[0]
    if arch.config.get("tie_word_embeddings", False):
        return total
    return total - 2 * arch.input_embedding_params / tp


# ----------------------------------------------------------------------------------------------
# The estimate for a config
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StepTime:
    """Seconds per RL step by component; `lines` is the printed breakdown."""
    rollout: float
    train: float
    sync: float
    total: float
    lines: tuple[str, ...]

    @property
    def summary(self) -> str:
        return (f"estimated step {_fmt(self.total)} (rollout {_fmt(self.rollout)}, train "
                f"{_fmt(self.train)}, sync {_fmt(self.sync)})")


def _attention_label(arch: Arch, requested: str) -> str:
    if arch.model_type not in EAGER_ONLY:
        return "  attention FLOPs"
    if attention_kernel(arch.model_type, requested) == "eager":  # only its memory is measured
        return "  attention: eager, timed at v4_attention's rate (a lower bound)"
    return "  attention at rl.models.v4_attention's measured rate"


def _row(label: str, seconds: float) -> str:
    return f"{label:<66}{_fmt(seconds):>12}"


def _fmt(s: float) -> str:
    if s >= 120:
        return f"{s / 60:,.1f} min"
    return f"{s:,.2f} s" if s >= 0.1 else f"{s * 1e3:,.1f} ms"


def _weight_sync(cfg: Config, arch: Arch, dev: Device) -> tuple[float, float, float, float]:
    """Weight sync, trainer rank 0 -> every engine (across nodes on a Slurm job):
    (wire bytes, link GB/s, seconds with the ZeRO-3 gather, seconds of that gather)."""
    p, t = cfg.plan, cfg.trainer
    fp8_wire = cfg.sync.wire_dtype == "fp8"
    wire = rollout_weight_bytes(arch, 1, True)[0] if fp8_wire else 2 * arch.total_params
    across = cfg.cluster.kind == "slurm" and cfg.cluster.rollout.gpus_per_node > 0
    link = dev.inter_node_gbps if across else dev.intra_node_gbps
    sync = sync_s(wire, link, p.sync_efficiency)
    gather = 0.0
    if t.zero_stage == 3:  # every parameter onto rank 0 before it is sent
        spans = cfg.cluster.num_nodes("trainer") > 1
        gather = ring_s(2 * arch.total_params, t.num_ranks,
                        dev.inter_node_gbps if spans else dev.intra_node_gbps)
    return wire, link, sync + gather, gather


def _not_counted(cfg: Config, arch: Arch) -> str:
    """The estimate's last line: what a step spends that it leaves out."""
    t, ep = cfg.trainer, cfg.trainer.expert_parallel_size
    return (f"not counted: {t.num_mini_batches * t.ppo_epochs} optimizer step(s)"
            + (f" (offloaded to {t.optimizer_offload}: 16 B of fp32 state per parameter moves "
               "each time" + ("; the routed experts' AdamW runs on the host CPU, their bf16 "
                              "gradients and weights cross PCIe" if ep > 1 else "") + ")"
               if t.optimizer_offload != "none" else "")
            + ", reward, evaluation, checkpoints"
            + (", V4 prefill attention (no measured inference rate)"
               if arch.model_type in EAGER_ONLY else ""))


def estimate(cfg: Config, arch: Arch, rollout: GroupPlan) -> StepTime:
    """The step-time estimate of `cfg` (`rollout`: its memory plan, for the KV layout)."""
    dev, p, t, r = device(cfg), cfg.plan, cfg.trainer, cfg.rollout
    seq = sequence_length(cfg)
    prompt = min(cfg.data.max_prompt_tokens, seq)
    samples = cfg.algorithm.prompts_per_step * r.n_samples
    tokens_rank = samples * seq / t.num_ranks
    mb_tokens = max(t.micro_batch_tokens, seq)
    micro_batches = math.ceil(tokens_rank / mb_tokens)
    comp = trainer_compute_s(arch, tokens_rank, seq, t.ppo_epochs, t.activation_checkpointing,
                             dev, p.mfu)
    comm = trainer_comm_s(cfg, arch, micro_batches, min(mb_tokens, tokens_rank), dev)
    train = sum(comp.values()) + sum(comm.values())

    fp8_wire = cfg.sync.wire_dtype == "fp8"
    wire, link, sync_total, gather = _weight_sync(cfg, arch, dev)

    # rollout: one engine's share of the step's samples, in waves the KV cache can hold
    tp, fp8 = r.tensor_parallel_size, r.quantization == "fp8"
    per_engine = math.ceil(samples / r.num_engines)
    rows = min(per_engine, rollout.concurrent) if rollout.concurrent else per_engine
    waves = math.ceil(per_engine / rows)
    kv = rollout.kv
    gen = decode_s(streamed_weight_bytes(arch, tp, fp8), kv.per_token, kv.per_sequence, rows,  # type: ignore[union-attr]  # lint baseline (issue 39)
                   prompt, r.max_new_tokens, matmul_params(arch),
                   attention_flops_per_token(arch, prompt), dev, p.mfu,
                   p.decode_step_overhead_ms * 1e-3, tp)
    roll = waves * sum(gen.values())

    staleness = cfg.algorithm.max_staleness
    total = roll + train + sync_total if staleness == 0 else max(roll, train + sync_total)
    ep = t.expert_parallel_size
    fabric = "IB" if cfg.cluster.num_nodes("trainer") > 1 else "NVLink"
    lines = [
        f"device {dev.name}: {dev.matmul_tflops:,.0f} TFLOP/s bf16, HBM {dev.hbm_gbps:,.0f} GB/s, "
        f"NVLink/xGMI {dev.intra_node_gbps:,.0f} GB/s, inter-node {dev.inter_node_gbps:,.0f} GB/s "
        "per GPU",
        f"  rates: {dev.source}",
        f"every response runs to max_new_tokens: {samples:,} sequences x {seq:,} tokens",
        f"trainer, per rank: {micro_batches} micro-batch(es) of {min(mb_tokens, tokens_rank):,.0f} "
        f"tokens, {t.ppo_epochs} epoch(s)",
        _row(f"  matmuls at {p.mfu:.1%} of peak (plan.mfu)", comp["matmul"]),
        _row(_attention_label(arch, t.attention_kernel), comp["attention"]),
        _row(f"  ZeRO-{t.zero_stage} collectives over {fabric}", comm["zero"]),
    ]
    if ep > 1:
        hops = ep_hops(cfg, arch)
        lines.append(_row(f"  expert parallel {ep}: all-to-all, expert gradients",
                          comm["all_to_all"]))
        lines.append(f"      dispatch in {len(hops)} hop(s), rows a token sends (uniform "
                     f"routing): {sum(h['inter'] for h in hops):.2f} to other nodes, "
                     f"{sum(h['intra'] for h in hops):.2f} inside its node")
    lines += [
        _row("  train", train),
        _row(f"weight sync: {wire / GB:,.1f} GB {'FP8' if fp8_wire else 'BF16'} at "
             f"{p.sync_efficiency:.0%} of {link:,.0f} GB/s"
             + (" + ZeRO-3 gather" if gather else ""), sync_total),
        f"rollout, per engine: {rows:,} rows x {waves} wave(s), {prompt:,} prompt + "
        f"{r.max_new_tokens:,} new tokens",
        _row("  prefill", waves * gen["prefill"]),
        _row(f"  decode: weights + KV over HBM + {p.decode_step_overhead_ms:g} ms per step",
             waves * gen["decode"]),
        _row("  rollout", roll),
        _row("step (on-policy: rollout + train + sync)" if staleness == 0 else
             f"step (max_staleness {staleness}: max(rollout, train + sync))", total),
        _not_counted(cfg, arch),
    ]
    return StepTime(roll, train, sync_total, total, tuple(lines))

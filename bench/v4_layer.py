"""Two DeepSeek-V4-Flash decoder layers, forward + backward on one GPU: step time, MFU on active
parameters (and with the attention core's FLOPs), peak memory, for transformers' eager attention,
the project's previous path and its current one (`fused`) in the same run, against the physical
limit.

The model is transformers' `DeepseekV4ForCausalLM` at the published V4-Flash dims
(`rl/plan/known/DeepSeek-V4-Flash.json`) cut to 2 layers, one CSA (compressed_sparse_attention,
rate 4, the indexer's top-512) and one HCA (heavily_compressed_attention, rate 128), with 64 of
the 256 routed experts (top-6), the shared expert and 4 hyper-connection streams; embedding,
final head and the 129,280-word LM head included, as in the trainer. BF16 with the modules V4
pins to fp32 kept fp32 (what `rl.models.loading.load_model` gives), random weights (sinks and
compressor position biases drawn N(0, 1): their init is 0), one sequence of S random tokens,
loss = transformers' cross-entropy on the shifted tokens. One step = forward + backward; no
optimizer, no DeepSpeed, no activation checkpointing (the trainer's default).

Paths (same weights, same tokens, one process):
- eager: transformers' `DeepseekV4Attention`, eager attention ((heads x S x (S+T)) scores), plus
  the project's fp32-norm boundary cast (`rl.models.v4_precision`) without which BF16 V4 cannot
  run a forward in transformers 5.19; transformers' decoder layer, `grouped_mm` experts.
- project: the project's path before `rl.models.v4_layer`: `v4_precision` plus
  `rl.models.v4_attention` (Triton forward and backward on a GPU, `RL_V4_ATTENTION_BWD=torch`
  for the older per-block recompute backward; the chunked torch path on a CPU); transformers'
  decoder layer, `grouped_mm` experts.
- fused: what `load_model` builds for a GPU (the default there since 2026-12-06): `project` plus `rl.models.v4_layer`
  (hyper-connections and norms as fused functions, compiled on CUDA; experts as one sort and two
  grouped GEMMs without scatter-adds).
- fused_nocompile (not run unless named): `fused` with `RL_V4_COMPILE=0`, the same functions
  eagerly: what the compiler adds.

FLOPs: 6 x active parameters x tokens, active = every parameter but the input embedding, routed
experts at top_k / E (as `bench.moe_actor`; the indexer, which gets no gradient, is counted at 6
too: ~1% of the total). The attention core (not in the parameters): per query, the keys it sees
(window, CSA picks or HCA's visible entries) x heads x 4 x head_dim for QK^T and PV, x 3 for
forward + backward, plus the indexer's forward scores (2 x index heads x index_head_dim per
visible entry). MFU divides by the bf16 matmul rate measured in the same run
(`bench.common.measure_bf16_peak`); `limit_s` is the time both FLOP counts take at that rate.
Left out: the optimizer step, hash-routed layers, sliding-only layers, padding / packing.

Run: python -m bench.v4_layer [--tokens 8192 18432] [--paths eager project fused] [--reps 5]
     [--profile]
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench.common import device_info, measure_bf16_peak, parse_args, sync, write_results

GiB = 2 ** 30
FLASH_JSON = Path(__file__).resolve().parents[1] / "rl/plan/known/DeepSeek-V4-Flash.json"
LAYER_TYPES = ["compressed_sparse_attention", "heavily_compressed_attention"]
PATHS = ("eager", "project", "fused")
ALL_PATHS = PATHS + ("fused_nocompile",)
TARGET_MFU = 0.35
# Small enough for a CPU in seconds; 8 indexer heads (fewer make top-k ties, see NOTES.md),
# windows and rates that several query positions cross at 64 tokens.
SMOKE = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, head_dim=32, q_lora_rank=16,
             qk_rope_head_dim=8, moe_intermediate_size=16, n_routed_experts=8,
             num_experts_per_tok=2, o_groups=2, o_lora_rank=8, index_n_heads=8,
             index_head_dim=16, index_topk=3, sliding_window=6, hc_sinkhorn_iters=3,
             compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8})


def flash_config(experts: int = 64, **overrides):
    """The published V4-Flash config.json, 2 layers (CSA, HCA), `experts` routed experts."""
    from rl.models.hf_classes import transformers_classes
    fields = json.loads(FLASH_JSON.read_text())
    for legacy in ("architectures", "compress_ratios", "num_hash_layers", "torch_dtype",
                   "transformers_version", "num_nextn_predict_layers"):
        fields.pop(legacy, None)
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    fields.update(num_hidden_layers=2, n_routed_experts=experts, layer_types=LAYER_TYPES,
                  mlp_layer_types=["moe", "moe"], compress_rates=rates,
                  attn_implementation="eager")
    fields.update(overrides)
    config_cls, _ = transformers_classes("deepseek_v4")
    return config_cls(**fields)


def build_model(config, device, dtype=torch.bfloat16):
    """The 2-layer V4 in `dtype` on `device` with the project's norm cast and grouped_mm experts."""
    from transformers import DeepseekV4ForCausalLM

    from rl.models import v4_precision
    torch.manual_seed(0)
    with torch.device(device):  # fp32-pinned modules (norms, mixers, sinks) stay fp32
        model = DeepseekV4ForCausalLM._from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias")):
                p.normal_(0, 1.0)
    v4_precision.install(model)
    model.set_experts_implementation("grouped_mm")
    return model.train()


_USER_COMPILE = os.environ.get("RL_V4_COMPILE")
"""RL_V4_COMPILE as the run was started (`fused` keeps it; `fused_nocompile` sets 0)."""


def use_path(model, path: str) -> None:
    """Switch `model` to `path` (see the module docstring) in place."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention

    from rl.models import v4_attention, v4_layer
    from rl.models.v4_attention.module import LinearV4Attention
    from rl.models.v4_layer import compiled
    if path not in ALL_PATHS:
        raise ValueError(f"path {path!r}; expected one of {ALL_PATHS}")
    v4_layer.restore(model, experts="grouped_mm")
    if path == "fused_nocompile":
        os.environ[compiled.ENV] = "0"
    elif _USER_COMPILE is None:
        os.environ.pop(compiled.ENV, None)
    else:
        os.environ[compiled.ENV] = _USER_COMPILE
    if path == "eager":
        model.set_attn_implementation("eager")
        for module in model.modules():
            if type(module) is LinearV4Attention:
                module.__class__ = DeepseekV4Attention
        return
    v4_attention.install(model)
    if path.startswith("fused"):
        v4_layer.install(model)


def active_params(model) -> int:
    """Parameters a token's forward multiplies by: all but the input embedding, routed experts
    at top_k / E."""
    config = model.config
    total = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    return int(total - routed * (1 - config.num_experts_per_tok / config.n_routed_experts))


def core_flops(config, seq: int) -> float:
    """Attention-core FLOPs of one forward + backward over `seq` tokens (see the docstring)."""
    window, heads, dim = config.sliding_window, config.num_attention_heads, config.head_dim
    index = 2 * config.index_n_heads * config.index_head_dim
    total = 0
    for kind in config.layer_types:
        rate = config.compress_rates.get(kind) if kind != "sliding_attention" else None
        for i in range(seq):
            visible = (i + 1) // rate if rate else 0
            keys = min(i + 1, window)
            if kind == "compressed_sparse_attention":
                keys += min(config.index_topk, visible)
                total += index * visible  # indexer scores, forward only
            else:
                keys += visible
            total += 3 * 4 * heads * dim * keys
    return float(total)


def _tokens(model, seq: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seq)
    ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=g)
    return ids.to(next(model.parameters()).device)


def _step(model, ids: torch.Tensor) -> torch.Tensor:
    """One forward + backward (gradients from scratch); returns the loss."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss


def measure(model, seq: int, path: str, warmup: int, reps: int) -> dict:
    """Median seconds of `reps` forward + backward steps after `warmup`, peak memory, loss."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    use_path(model, path)
    ids = _tokens(model, seq)
    row = {"tokens": seq, "path": path}

    def step() -> torch.Tensor:
        return _step(model, ids)

    try:
        for _ in range(warmup):  # Triton compiles, allocator warms
            step()
        gc.collect()
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            loss = step()
            sync()
            times.append(time.perf_counter() - t0)
        row.update(result="ok", seconds=statistics.median(times), loss=loss.item(),
                   grad_norm=torch.linalg.vector_norm(torch.stack(
                       [p.grad.float().norm() for p in model.parameters()
                        if p.grad is not None])).item())
        if cuda:
            row["peak_GiB"] = torch.cuda.max_memory_allocated() / GiB
    except torch.OutOfMemoryError:
        row["result"] = "OOM"
    model.zero_grad(set_to_none=True)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def profile_step(model, seq: int, path: str, out_path: Path) -> None:
    """One (warm) step of `path` under torch.profiler: wall vs device time, then the operators
    with the most self device time, into `out_path`."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    use_path(model, path)
    ids = _tokens(model, seq)
    cuda = ids.is_cuda
    _step(model, ids)
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        _step(model, ids)
        sync()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    # operators' self device time (what the table's "Self CUDA time total" sums): the kernel
    # rows repeat the same time
    busy = sum(e.self_device_time_total for e in events
               if e.device_type == DeviceType.CPU and not e.is_user_annotation) / 1e6
    head = (f"{path} path, {seq:,} tokens, one forward + backward under torch.profiler: wall "
            f"{wall * 1e3:.0f} ms" + (f", device kernels {busy * 1e3:.0f} ms" if cuda else ""))
    model.zero_grad(set_to_none=True)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(head + "\n\n" + events.table(sort_by=key, row_limit=40,
                                                     max_name_column_width=70) + "\n")
    print(head, flush=True)


def notes_on(rows: list[dict], smoke: bool) -> list[str]:
    """Targets marked MET / NOT MET and the paths' loss agreement, per token count."""
    notes = []
    for seq in sorted({r["tokens"] for r in rows}):
        at = {r["path"]: r for r in rows if r["tokens"] == seq and r["result"] == "ok"}
        ours = [r for p, r in at.items() if p != "eager"]
        if ours:
            # the best of the project's paths decides; each one's figure is listed
            best = max(ours, key=lambda r: r["MFU_active"])
            met = "MET" if best["MFU_active"] >= TARGET_MFU else "NOT MET"
            each = ", ".join(f"{r['path']}: {r['MFU_active']:.1%}"
                             for r in sorted(ours, key=lambda r: -r["MFU_active"]))
            notes.append(f"target >= {TARGET_MFU:.0%} MFU on active params at {seq:,} tokens: "
                         f"{met} ({each}{', smoke run: not a measurement' if smoke else ''})")
        else:
            notes.append(f"target at {seq:,} tokens not decided: no project path ran")
        for base in ("eager", "project"):
            if base not in at:
                continue
            for path, r in at.items():
                if path in ("eager", base):
                    continue
                ref = at[base]
                rel = abs(r["loss"] - ref["loss"]) / abs(ref["loss"])
                grad = r["grad_norm"] / ref["grad_norm"] - 1
                notes.append(f"loss {path} vs {base} at {seq:,} tokens: {r['loss']:.5f} vs "
                             f"{ref['loss']:.5f} (relative difference {rel:.1e}); gradient "
                             f"norm {grad:+.1e} relative")
    return notes


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], lambda p: (
        p.add_argument("--tokens", type=int, nargs="+", default=[8192, 18432]),
        p.add_argument("--paths", nargs="+", default=list(PATHS), choices=ALL_PATHS),
        p.add_argument("--experts", type=int, default=64),
        p.add_argument("--warmup", type=int, default=2),
        p.add_argument("--reps", type=int, default=5),
        p.add_argument("--profile", action="store_true",
                       help="then one step of the last path at the first token count under "
                            "torch.profiler: <out>/v4_layer_profile.txt")))
    if args.smoke:
        config, device, dtype = flash_config(**SMOKE), "cpu", torch.bfloat16
        args.tokens, args.warmup, args.reps = [64], 1, 2
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench.v4_layer needs a CUDA GPU (or --smoke on CPU)")
        config, device, dtype = flash_config(args.experts), "cuda", torch.bfloat16
    peak = measure_bf16_peak(device, 256 if args.smoke else 8192)  # TFLOP/s
    model = build_model(config, device, dtype)
    active = active_params(model)
    weights_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / GiB
    rows = []
    for seq in args.tokens:
        param_flops, attn_flops = 6.0 * active * seq, core_flops(config, seq)
        limit = (param_flops + attn_flops) / (peak * 1e12)
        eager_s = None
        for path in args.paths:
            row = measure(model, seq, path, args.warmup, args.reps)
            row["limit_s"] = limit
            if row["result"] == "ok":
                s = row["seconds"]
                row.update(tokens_per_s=seq / s, MFU_active=param_flops / s / (peak * 1e12),
                           MFU_with_core=(param_flops + attn_flops) / s / (peak * 1e12))
                eager_s = s if path == "eager" else eager_s
                row["speedup_vs_eager"] = eager_s / s if eager_s else None
            print(row, flush=True)
            rows.append(row)
    total = sum(p.numel() for p in model.parameters())
    info = {**device_info(), "bf16_peak_TFLOPs": peak, "params": total, "active_params": active,
            "weights_GiB": weights_gib, "dtype": str(dtype).removeprefix("torch."),
            "warmup": args.warmup, "reps": args.reps,
            "config": {k: getattr(config, k) for k in (
                "hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups",
                "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk",
                "sliding_window", "compress_rates", "moe_intermediate_size",
                "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "hc_mult",
                "hc_sinkhorn_iters", "vocab_size", "layer_types")}}
    notes = [f"model: DeepSeek-V4 {'tiny smoke dims' if args.smoke else 'Flash dims'}, 2 layers "
             f"(CSA, HCA), {config.n_routed_experts} experts top-{config.num_experts_per_tok} + "
             f"{config.n_shared_experts} shared, hc_mult {config.hc_mult}, vocab "
             f"{config.vocab_size:,}: {total / 1e6:,.4g} M parameters ({weights_gib:.2f} GiB), "
             f"{active / 1e6:,.4g} M active",
             f"step: forward + backward of one sequence, {args.reps} timed after {args.warmup} "
             "warm-up, median, synchronised; peak_GiB = max allocated over the timed steps "
             "(weights and gradients included)",
             f"MFU against the bf16 matmul rate measured in this run, {peak:,.0f} TFLOP/s "
             "(datasheet dense bf16 for H100/H200 SXM: ~989); limit_s = (6 x active x tokens + "
             "attention-core FLOPs) at that rate",
             "eager = transformers' attention and layer (+ rl.models.v4_precision); project = "
             "+ rl.models.v4_attention (the project's path before rl.models.v4_layer); both "
             "grouped_mm experts; fused = + rl.models.v4_layer (compiled on CUDA), what "
             "load_model installs on a GPU"]
    name = "v4_layer_smoke" if args.smoke else "v4_layer"
    notes += notes_on(rows, args.smoke)
    if args.profile:
        profile_step(model, args.tokens[0], args.paths[-1], Path(args.out) / f"{name}_profile.txt")
        notes.append(f"profile of one {args.paths[-1]} step at {args.tokens[0]:,} tokens: "
                     f"{name}_profile.txt")
    write_results(name, args.out, info, rows,
                  ["tokens", "path", "result", "seconds", "limit_s", "tokens_per_s",
                   "MFU_active", "MFU_with_core", "peak_GiB", "speedup_vs_eager", "loss"], notes)


if __name__ == "__main__":
    main()

"""Where a native-engine decode step spends its time: per kernel group, per step, for BF16 / FP8
weights x BF16 / FP8 KV cache, from the PyTorch profiler (CUPTI: kernels inside the CUDA graphs
are reported too). Issue 16's "profile before optimising".

    python -m bench.decode_profile [--batch 256] [--prompt-len 896] [--new 128]
                                   [--attention single,split]

One generate call per configuration on a random Qwen3-0.6B-shaped model, prompts of
`--prompt-len` random tokens and exactly `--new` sampled tokens, so every decode step attends
over ~prompt-len + new/2 tokens of context (896 + 128: the last eighth of a 1,024-token
generation, where the KV cache dominates the bytes). Per configuration:
- per kernel group (attention, GEMMs, q/k-norm + RoPE + cache write, RMSNorm, SiLU, sampling,
  other): microseconds per decode step, share of the GPU's busy time, kernels per step;
- wall time per step, GPU busy time per step (the gap is host and launch overhead), and the
  attention kernel's effective bandwidth: the KV bytes a step must read / its attention time,
  next to the copy bandwidth measured in the same run (the attention's own roofline).
Prefill and other one-off work are left out of the per-step figures: each configuration runs
one call of `--new` tokens and one of half as many, and the per-step figures are their
difference over the difference in steps (a prefill kernel that shares a decode kernel's name
would otherwise count as decode time).

`--attention`: the decode attention kernels to compare, each over all four configurations:
`rollout.decode_attention` modes (single, split, auto) or a fixed number of context splits
(1 = single); the `splits` column says how many each used (the attention group then holds the
split kernel and its combine kernel).

`--smoke`: a tiny model on the CPU (torch kernels, CPU operator times), to exercise the code.
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch.autograd import DeviceType

from bench.common import (QWEN3_06B, TINY, attention_choices, device_info, hf_config,
                          measure_copy_bandwidth, parse_args, random_model, sync, write_results)

GROUPS = (("attention", ("decode_attn", "attention", "sdpa", "flash")),
          ("qk-norm+rope+cache", ("qk_rope_cache", "rope", "qk_norm")),
          ("rmsnorm", ("rmsnorm", "rms_norm")),
          ("silu", ("silu",)),
          ("gemm", ("gemm", "nvjet", "cutlass", "sm90", "_linear_kernel", "grouped", "mma",
                    "matmul", "addmm", "aten::mm", "aten::bmm", "scaled_mm", "w8a8")),
          ("fp8 activation quant", ("act_quant",)),
          ("sampling", ("sample", "softmax", "exponential", "multinomial", "argmax", "topk", "sort",
                        "log_softmax", "gather", "div", "isin", "max")))


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other"


def profile(engine, prompts, new: int, gpu: bool) -> tuple[dict, float]:
    """({kernel name: (calls, total us)}, wall seconds) of one generate call."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from rl.rollout.base import SamplingParams
    engine.generate(prompts, SamplingParams(max_new_tokens=3, seed=1))  # graphs, compiles
    sync()
    acts = [ProfilerActivity.CUDA] if gpu else [ProfilerActivity.CPU]
    with torch_profile(activities=acts) as prof:
        t0 = time.perf_counter()
        engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new, seed=2))
        sync()
        wall = time.perf_counter() - t0
    # GPU: the kernels themselves (an aten op's entry would count its kernels' time again);
    # CPU: aten ops by self time (their nested ops counted once).
    kernels = {}
    for e in prof.key_averages():
        if gpu and e.device_type == DeviceType.CUDA:
            us = e.self_device_time_total
        elif not gpu and e.key.startswith("aten::"):
            us = e.self_cpu_time_total
        else:
            continue
        if us > 0:
            kernels[e.key] = (e.count, us)
    return kernels, wall


def per_step(long: dict, short: dict, steps: int) -> tuple[dict, float, list]:
    """Per group: [us per step, kernels per step]; the GPU busy us per step; the kernels by us
    per step, largest first. A kernel's per-step figure is its (calls, time) in the long call
    minus those in the short one, over the `steps` more decode steps the long call ran: prefill
    and one-off work cancel even where a prefill kernel shares a decode kernel's name."""
    groups = defaultdict(lambda: [0.0, 0.0])
    kernels = []
    for name, (calls, us) in long.items():
        calls0, us0 = short.get(name, (0, 0.0))
        if calls - calls0 < steps:  # not launched at every decode step
            continue
        g = groups[group_of(name)]
        g[0] += (us - us0) / steps
        g[1] += (calls - calls0) / steps
        kernels.append(((us - us0) / steps, name))
    return dict(groups), sum(g[0] for g in groups.values()), sorted(kernels, reverse=True)


def main() -> None:
    from rl.config import RolloutConfig
    from rl.models.name_maps import full_state_for_engine
    from rl.rollout.native.engine import NativeEngine
    from rl.rollout.native.model import Shape

    args = parse_args(__doc__.splitlines()[0], lambda p: (
        p.add_argument("--batch", type=int, default=256),
        p.add_argument("--prompt-len", type=int, default=896),
        p.add_argument("--new", type=int, default=128),
        p.add_argument("--no-graphs", action="store_true",
                       help="decode without CUDA graphs (if the profiler misses graph kernels)"),
        p.add_argument("--attention", default="single,split",
                       help="comma list of rollout.decode_attention modes or split counts")))
    gpu = not args.smoke
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    fields = QWEN3_06B if gpu else TINY
    batch, prompt_len, new = (args.batch, args.prompt_len, args.new) if gpu else (2, 8, 6)
    bw = measure_copy_bandwidth(device, 2.0 if gpu else 0.02) * 1e9
    config = hf_config("qwen3", fields)
    shape = Shape.from_hf_config(config)
    state = full_state_for_engine(random_model("qwen3", fields, device, dtype))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, shape.vocab, (batch, prompt_len), generator=g).tolist()
    rows, summary = [], []
    configs = [(quant, kv, mode, fixed) for quant, kv in (("none", "auto"), ("none", "fp8"),
                                                         ("fp8", "auto"), ("fp8", "fp8"))
               for mode, fixed in attention_choices(args.attention)]
    for quant, kv, mode, fixed in configs:
        cfg = RolloutConfig(engine="native", quantization=quant, max_batch_size=batch,
                            max_model_len=prompt_len + new, max_new_tokens=new,
                            kv_cache_dtype=kv, cuda_graphs=not args.no_graphs,
                            decode_attention=mode)
        engine = NativeEngine.from_config(config, cfg, device=device,
                                          dtype="bfloat16" if gpu else "float32")
        engine.load_weights(state, version=1)
        engine.model.fixed_splits = fixed
        splits = engine.model.attention_splits(batch)   # batch = its bucket (max_batch_size)
        name = ("FP8" if quant == "fp8" else "BF16") + " weights + " + (
            "FP8" if kv == "fp8" else "BF16") + " KV, " + (
            f"{mode} attention" if fixed is None else f"{fixed} splits")
        kv_step = engine.model.cache_bytes(1) / cfg.max_model_len * batch * (
            prompt_len + new * 3 / 4)
        short = max(2, new // 2)
        long_k, wall = profile(engine, prompts, new, gpu)
        short_k, wall_short = profile(engine, prompts, short, gpu)
        groups, busy, top = per_step(long_k, short_k, new - short)
        engine.shutdown()
        del engine
        for group, (us, count) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
            rows.append({"engine": name, "splits": splits, "group": group, "us_per_step": us,
                         "share_of_busy": us / busy if busy else None,
                         "kernels_per_step": count})
        attn = groups.get("attention", [0.0])[0]
        summary.append({"engine": name, "splits": splits, "group": "(step)",
                        "us_per_step": (wall - wall_short) / (new - short) * 1e6,
                        "gpu_busy_us": busy,
                        "kernels_per_step": sum(c for _, c in groups.values()),
                        "kv_MB_per_step": kv_step / 1e6,
                        "attention_GBps": kv_step / (attn * 1e-6) / 1e9 if attn else None,
                        "top_kernels": "; ".join(f"{n[:60]} {us:.0f}" for us, n in top[:6])})
        print(summary[-1], flush=True)
    info = {**device_info(), "copy_GBps": bw / 1e9}
    notes = [f"batch {batch}, prompts of {prompt_len} random tokens, {new} sampled tokens "
             f"(temperature 1, no EOS); per-step figures: a call of {new} tokens minus one of "
             f"{max(2, new // 2)} (its prefill included) over the difference in steps, i.e. the "
             "decode steps of the second half, prefill and one-off work cancelled",
             "splits: context splits of the decode attention per (row, kv head); 1 = the "
             "single-pass kernel (on CPU the torch reference runs whatever it says)",
             "(step) rows: us_per_step = wall time per decode step (the two calls' difference); "
             "gpu_busy_us = the kernels' time per decode step; kv_MB_per_step = the KV bytes one "
             "step reads at those steps' mean context; attention_GBps = those bytes / the "
             "attention kernel's time; top_kernels: the six largest kernels, us per step",
             f"copy bandwidth measured in this run: {bw / 1e9:,.0f} GB/s (read + write), the "
             "attention kernel's reference",
             "groups by kernel name: " + "; ".join(f"{g}: {', '.join(k)}" for g, k in GROUPS)]
    if gpu and not any(r["group"] == "attention" for r in rows):
        notes.append("WARNING: no attention kernel was reported: the profiler did not see the "
                     "kernels inside the CUDA graphs; rerun with --no-graphs")
    columns = ["engine", "splits", "group", "us_per_step", "share_of_busy", "kernels_per_step",
               "gpu_busy_us", "kv_MB_per_step", "attention_GBps", "top_kernels"]
    write_results("decode_profile" + ("_smoke" if args.smoke else ""), args.out, info,
                  summary + rows, columns, notes)


if __name__ == "__main__":
    main()

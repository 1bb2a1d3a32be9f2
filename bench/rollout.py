"""Rollout throughput: native engine (FP8 and BF16 weights, BF16 or FP8 KV cache) vs HF `generate`
(BF16) vs the decode roofline, on random Qwen3-0.6B-shaped and small Qwen3-MoE-shaped models (and,
with `--models dense4b`, Qwen3-4B-shaped), one GPU; and how many sequences each native
configuration holds in the same memory.

Every configuration: `--batches` prompts of `--prompt-len` random tokens, exactly `new` sampled
tokens each (temperature 1, no EOS), tokens/s = batch x new / wall time of the whole call
(prefill, decode, sampling, results back on the host); each call is repeated until
`--min-seconds` of calls are timed (at most 5) and the median reported (`runs`): a 0.25 s call
varies by several % from one run to the next. HF runs only up to `--hf-max-new` new tokens
(its 1024-token runs would take minutes of device time; they are reported as not run).

The four engines the targets compare (FP8 / BF16 weights x BF16 / FP8 KV cache) are built
together and timed in rounds (`run_rounds`: each round calls every engine once, the order
rotated): their ratio to native BF16 is the median of the per-round ratios, with its range.
Timed one engine after the other, minutes apart, the GPU's drift moved a ratio by up to 5%
between two runs of the same code (FP8 weights at 64 x 128: 0.945 in one run, 0.999 in the
run before).

Roofline (per configuration, for that engine's weight format): prefill at max(FLOPs / measured
bf16 matmul peak, weight bytes / bandwidth), plus every decode step at (weight bytes read + KV
cache bytes read for every row's context) / measured copy bandwidth (bytes read + written per
second of a device-to-device copy). MoE: all experts count as read (at these batch sizes every
expert receives tokens). KV bytes are the engine's own (1 B + a 1-byte scale per 128 with FP8).

Max sequences: in one budget per model, `--mem-fraction` of the GPU's memory minus the engine's
weights and `--overhead-gb`, how many sequences of prompt + max(new) tokens the engine's KV cache
holds (`NativeQwen3.max_cache_rows`, the memory planner's formula); the cache of that many rows
is then really allocated (its GB are reported).

`--attention single,split` (rollout.decode_attention modes, or fixed split counts) runs every
native configuration once per decode attention kernel, side by side; rows of a mode other than
`single` (the default) name it in the engine column, and vs_native_bf16 stays relative to native
bf16 with the single-pass kernel.

"native fp8 (GEMM sums its split-K)": the FP8-weight engine with our split-K W8A8 kernel summing
its partials itself (two more launches per o / down GEMM), the path before the RMSNorm after
those GEMMs summed them (`kernels.Partials`); the same weights, side by side.

Run: python -m bench.rollout
"""
from __future__ import annotations

import gc
import statistics
import time

import torch

from bench.common import (QWEN3_06B, QWEN3_4B, QWEN3_MOE_SMALL, TINY, TINY_MOE, attention_choices,
                          device_info, hf_config, measure_bf16_peak, measure_copy_bandwidth,
                          parse_args, random_model, sync, write_results)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def roofline_seconds(shape, weight_bytes: int, batch: int, prompt: int, new: int, bw: float,
                     peak: float, kv_token: float | None = None) -> float:
    """Lower bound on generate time (see the module docstring). bw in B/s, peak in FLOP/s;
    kv_token: KV bytes per token of context, all layers (None: bf16 K and V)."""
    s = shape
    embed = s.vocab * s.hidden * 2
    w_step = weight_bytes - (0 if s.tied else embed)   # the embedding table is not read whole
    if kv_token is None:
        kv_token = s.layers * 2 * s.nkv * s.head_dim * 2
    attn = s.hidden * (s.nh + 2 * s.nkv) * s.head_dim + s.nh * s.head_dim * s.hidden
    mlp = [3 * s.hidden * (s.top_k * s.moe_inter if m else s.inter) for m in s.is_moe]
    body = s.layers * attn + sum(mlp)                  # active matmul params per token
    flops = 2 * body * batch * prompt + 2 * s.vocab * s.hidden * batch
    flops += 4 * s.layers * s.nh * s.head_dim * batch * prompt * prompt / 2
    t = max(flops / peak, w_step / bw)
    for step in range(1, new):
        t += (w_step + batch * (prompt + step) * kv_token) / bw
    return t


# Engines timed together per model where one H200's memory cannot hold all four caches of
# 256 x 1,152 tokens at once (Qwen3-4B: 43.5 GB per BF16 cache); each group pairs with native
# bf16. Others: the four in one group.
GROUPS = {"dense4b": [[("none", "auto"), ("fp8", "fp8"), ("none", "fp8")],
                      [("none", "auto"), ("fp8", "auto")]]}


def _call_seconds(engine, prompts, new: int) -> float:
    from rl.rollout.base import SamplingParams
    t0 = time.perf_counter()
    out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new, seed=2))
    sync()
    secs = time.perf_counter() - t0
    assert all(len(g[0].response_ids) == new for g in out), "a sequence stopped early"
    return secs


def run_rounds(engines: dict, prompts, new: int, min_seconds: float = 0.0,
               min_rounds: int = 1, max_rounds: int = 5) -> dict[str, list[float]]:
    """Seconds of every generate call, per engine name, timed in rounds: a round calls each
    engine once, starting one engine later than the round before, so that drift of the GPU
    over the minutes of a run and the order of the calls fall alike on every engine (their
    per-round ratios pair them). Rounds go on until each engine has `min_seconds` timed,
    at least `min_rounds` and at most `max_rounds` of them. Each engine is warmed first (graph
    capture, compiles)."""
    from rl.rollout.base import SamplingParams
    for engine in engines.values():
        engine.generate(prompts, SamplingParams(max_new_tokens=3, seed=1))
    sync()
    names = list(engines)
    times: dict[str, list[float]] = {n: [] for n in names}
    r = 0
    while r < max_rounds and (r < min_rounds
                              or min(sum(t) for t in times.values()) < min_seconds):
        for j in range(len(names)):
            n = names[(r + j) % len(names)]
            times[n].append(_call_seconds(engines[n], prompts, new))
        r += 1
    return times


def run_hf(model, prompts, new: int) -> float:
    from transformers import GenerationConfig
    ids = torch.tensor(prompts, device=model.device)
    gen = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                           max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                   generation_config=GenerationConfig(do_sample=False, max_new_tokens=2,
                                                      pad_token_id=0))
    sync()
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    sync()
    assert out.shape[1] == ids.shape[1] + new
    return time.perf_counter() - t0


def release_cache(engine) -> None:
    """Drop the engine's graphs and KV cache, and give their memory back (weights stay)."""
    engine.shutdown()                      # the captured graphs point into the cache
    engine.model.cache, engine.model.cache_rows = None, 0
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None


def max_sequences(engine, budget: float) -> tuple[int, float]:
    """(sequences of max_model_len whose cache fits in `budget` bytes, GB of that cache as
    allocated). Drops the engine's graphs and cache: call it last."""
    model = engine.model
    rows = model.max_cache_rows(budget)
    release_cache(engine)
    model.ensure_cache(rows)
    c = model.cache
    got = sum(t.numel() * t.element_size() for t in (c.k, c.v, c.k_exp, c.v_exp) if t is not None)
    model.cache, model.cache_rows = None, 0
    return rows, got / 1e9


def main() -> None:
    from rl.config import RolloutConfig
    from rl.models.name_maps import full_state_for_engine
    from rl.rollout.native.engine import NativeEngine, _bucket
    from rl.rollout.native.model import Shape

    args = parse_args(__doc__.splitlines()[0], lambda p: (
        p.add_argument("--batches", default="64,256"), p.add_argument("--new", default="128,1024"),
        p.add_argument("--prompt-len", type=int, default=128),
        p.add_argument("--models", default="dense,moe",
                       help="comma list of dense (Qwen3-0.6B), moe (Qwen3-MoE-small), dense4b "
                            "(Qwen3-4B: not in the default list)"),
        p.add_argument("--speed-only", action="store_true",
                       help="only the four engines the targets compare, timed in rounds: no HF "
                            "generate, no split-K-summing or other --attention variants, no "
                            "max_seqs"),
        p.add_argument("--hf-max-new", type=int, default=128),
        p.add_argument("--mem-fraction", type=float, default=0.85),
        p.add_argument("--overhead-gb", type=float, default=5.0),
        p.add_argument("--min-seconds", type=float, default=1.5,
                       help="time each native call until this many seconds (at most 5 calls)"),
        p.add_argument("--attention", default="single",
                       help="comma list of rollout.decode_attention modes or split counts")))
    gpu = not args.smoke
    device = "cuda" if gpu else "cpu"
    dtype = torch.bfloat16 if gpu else torch.float32
    batches, news = (_ints(args.batches), _ints(args.new)) if gpu else ([2], [6])
    modes = attention_choices(args.attention)
    prompt_len = args.prompt_len if gpu else 8
    bw = measure_copy_bandwidth(device, 2.0 if gpu else 0.02) * 1e9
    peak = measure_bf16_peak(device, 8192 if gpu else 256) * 1e12
    shapes = {"dense": ("qwen3", QWEN3_06B if gpu else TINY, "Qwen3-0.6B"),
              "moe": ("qwen3_moe", QWEN3_MOE_SMALL if gpu else TINY_MOE, "Qwen3-MoE-small"),
              "dense4b": ("qwen3", QWEN3_4B if gpu else TINY, "Qwen3-4B")}
    rows = []
    g = torch.Generator().manual_seed(0)
    if not gpu:
        args.overhead_gb = 0.0
    info = {**device_info(), "copy_GBps": bw / 1e9, "bf16_peak_TFLOPs": peak / 1e12}
    notes = [f"prompts: {prompt_len} random tokens; sampling temperature 1, no EOS, exactly "
             "new_tokens per sequence; tokens/s counts new tokens over the whole generate call",
             f"measured: copy bandwidth {bw / 1e9:,.0f} GB/s (read + write), bf16 matmul peak "
             f"{peak / 1e12:,.0f} TFLOP/s (8192^3)",
             "roofline: prefill max(FLOPs/peak, bytes/bw) + per decode step (weights + every "
             "row's KV context) / bw, for that engine's own weight bytes",
             f"HF generate runs only up to {args.hf_max_new} new tokens (device-time budget)",
             f"max_seqs: sequences of {prompt_len} + {max(news)} tokens in {args.mem_fraction} x "
             f"GPU memory - weights - {args.overhead_gb:g} GB (the cache is allocated; cache_GB)",
             "attn_splits: context splits per (row, kv head) of the native decode attention "
             "at that batch (1 = the single-pass kernel)",
             "vs_native_bf16: tokens/s over native bf16 (BF16 weights and KV cache) at the same "
             "model, batch and length; for the four engines with a vs_bf16_range (FP8 / BF16 "
             "weights x BF16 / FP8 KV, single-pass attention), timed in rounds: each round "
             "calls every engine once, starting one engine later each round, and the figure is "
             "the median of the rounds' ratios (range: their smallest and largest), so that the "
             "GPU's drift over the run falls alike on both sides; other rows: over native "
             "bf16's median",
             "native fp8 (GEMM sums its split-K): o / down's split-K partials summed by the GEMM "
             "(two launches each) instead of by the RMSNorm that reads them",
             f"runs: generate calls timed (median reported): until {args.min_seconds:g} s, at "
             "most 5 (the four engines in rounds: at least 3)",
             "targets (0.6B, batch 256): native FP8 >= 4x HF generate; >= 35% of roofline; "
             "FP8 weights + FP8 KV >= 1.5x native bf16 at 1024 new tokens; ~2x max_seqs"]
    columns = ["model", "engine", "attn_splits", "batch", "new_tokens", "runs", "seconds",
               "tokens_per_s",
               "vs_HF", "vs_native_bf16", "vs_bf16_range", "roofline_tokens_per_s",
               "fraction_of_roofline",
               "weight_GB", "max_seqs", "cache_GB"]
    total_mem = (torch.cuda.get_device_properties(0).total_memory if gpu else 2 ** 30)

    models = [shapes[k][2] for k in args.models.split(",")]
    ranks: dict[str, int] = {}

    def engine_rank(name: str) -> int:  # the table keeps the engine order of the runs before
        order = ["native fp8", "native fp8 (GEMM sums its split-K)", "native fp8 + fp8 kv",
                 "HF generate bf16", "native bf16", "native bf16 + fp8 kv"]
        return order.index(name) if name in order else ranks.setdefault(name, 100 + len(ranks))

    def save(row: dict) -> None:  # after every row, so a time limit leaves partial results
        rows.append(row)
        print(row, flush=True)
        for r in rows:  # speed-up over HF at the same model / batch / length
            base = [h for h in rows if h["engine"].startswith("HF") and h["model"] == r["model"]
                    and h["batch"] == r.get("batch") and h["new_tokens"] == r.get("new_tokens")]
            if base and isinstance(base[0].get("tokens_per_s"), float) and "tokens_per_s" in r:
                r["vs_HF"] = r["tokens_per_s"] / base[0]["tokens_per_s"]
            base = [h for h in rows if h["engine"] == "native bf16" and h["model"] == r["model"]
                    and h.get("batch") == r.get("batch")
                    and h.get("new_tokens") == r.get("new_tokens")]
            if (base and "tokens_per_s" in base[0] and isinstance(r.get("tokens_per_s"), float)
                    and "vs_bf16_range" not in r):   # paired rows keep their per-round median
                r["vs_native_bf16"] = r["tokens_per_s"] / base[0]["tokens_per_s"]
        rows.sort(key=lambda r: (models.index(r["model"]), engine_rank(r["engine"]),
                                 r.get("batch") or 1 << 30, r.get("new_tokens") or 1 << 30))
        write_results("rollout" + ("_smoke" if args.smoke else ""), args.out, info, rows,
                      columns, notes, quiet=True)

    for key in args.models.split(","):
        mtype, fields, label = shapes[key]
        config = hf_config(mtype, fields)
        shape = Shape.from_hf_config(config)
        hf = random_model(mtype, fields, device, dtype)
        state = full_state_for_engine(hf)
        prompts = {b: torch.randint(2, shape.vocab, (b, prompt_len), generator=g).tolist()
                   for b in batches}

        def build(quant: str, kv: str, fused: bool, mode: str, fixed: int | None):
            """(engine name, engine, its RolloutConfig)."""
            cfg = RolloutConfig(engine="native", quantization=quant, max_batch_size=max(batches),
                                max_model_len=prompt_len + max(news), max_new_tokens=max(news),
                                kv_cache_dtype=kv, decode_attention=mode)
            engine = NativeEngine.from_config(config, cfg, device=device,
                                              dtype="bfloat16" if gpu else "float32")
            engine.load_weights(state, version=1)
            engine.model.fixed_splits = fixed
            engine.model.fused_partials = fused
            name = "native " + ("fp8" if quant == "fp8" else "bf16") + (
                " + fp8 kv" if kv == "fp8" else "") + (
                "" if fused else " (GEMM sums its split-K)") + (
                f" ({fixed} splits)" if fixed is not None else
                "" if mode == "single" else f" ({mode} attention)")
            return name, engine, cfg

        timed: set[tuple[str, int, int]] = set()

        def time_group(group: dict, paired: bool) -> None:
            """Every shape of `group` {name: (engine, cfg)} in rounds (`run_rounds`); paired:
            vs_native_bf16 is the median of the per-round ratios to "native bf16" in it (whose
            own rows come from the first group it was timed in)."""
            for b in batches:
                for new in news:
                    times = run_rounds({n: e for n, (e, _) in group.items()}, prompts[b], new,
                                       args.min_seconds if gpu else 0.0,
                                       min_rounds=(3 if gpu else 1) if paired else 1)
                    for name, (engine, cfg) in group.items():
                        wbytes = engine.model.weight_bytes()
                        kv_token = engine.model.cache_bytes(1) / cfg.max_model_len
                        secs = statistics.median(times[name])
                        roof = roofline_seconds(shape, wbytes, b, prompt_len, new, bw, peak,
                                                kv_token)
                        row = {"model": label, "engine": name,
                               "attn_splits": engine.model.attention_splits(
                                   _bucket(b, cfg.max_batch_size)),
                               "batch": b, "new_tokens": new, "runs": len(times[name]),
                               "seconds": secs, "tokens_per_s": b * new / secs,
                               "roofline_tokens_per_s": b * new / roof,
                               "fraction_of_roofline": roof / secs,
                               "weight_GB": wbytes / 1e9}
                        if paired:
                            ratios = [t0 / t for t0, t in zip(times["native bf16"], times[name])]
                            row.update(vs_native_bf16=statistics.median(ratios),
                                       vs_bf16_range=f"{min(ratios):.3f}-{max(ratios):.3f}")
                        if (name, b, new) not in timed:
                            timed.add((name, b, new))
                            save(row)

        # The four engines the targets compare, side by side in rounds (one GPU memory holds
        # their caches; Qwen3-4B's in two groups sharing native bf16); then, one at a time, the
        # FP8 engine with our split-K GEMM summing its own partials (the path before the RMSNorm
        # summed them, `NativeQwen3.fused_partials`), the other --attention modes, and HF
        # generate (not with --speed-only).
        main_four = [("fp8", "auto"), ("fp8", "fp8"), ("none", "auto"), ("none", "fp8")]
        groups = GROUPS.get(key, [main_four])
        for members in groups:
            group = {}
            for quant, kv in members:
                name, engine, cfg = build(quant, kv, True, *modes[0])
                group[name] = (engine, cfg)
            time_group(group, paired=True)
            for engine, _ in group.values():
                release_cache(engine)
            for name, (engine, _) in group.items():  # as many sequences whatever the kernels
                if not args.speed_only:
                    wbytes = engine.model.weight_bytes()
                    budget = args.mem_fraction * total_mem - wbytes - args.overhead_gb * 1e9
                    seqs, cache_gb = max_sequences(engine, budget)
                    save({"model": label, "engine": name, "weight_GB": wbytes / 1e9,
                          "max_seqs": seqs, "cache_GB": cache_gb})
            del group, engine
            gc.collect()
        if not args.speed_only:   # the variants and HF generate
            others = [("fp8", "auto", False, modes[0])] + [
                (q, kv, True, m) for m in modes[1:] for q, kv in main_four]
            for quant, kv, fused, mode in others:
                name, engine, cfg = build(quant, kv, fused, *mode)
                time_group({name: (engine, cfg)}, paired=False)
                release_cache(engine)
                del engine
            hf_bytes = sum(t.numel() * t.element_size() for t in hf.parameters())
            for b in batches:
                for new in news:
                    row = {"model": label, "engine": "HF generate bf16", "batch": b,
                           "new_tokens": new, "weight_GB": hf_bytes / 1e9}
                    roof = roofline_seconds(shape, hf_bytes, b, prompt_len, new, bw, peak)
                    row["roofline_tokens_per_s"] = b * new / roof
                    if new <= args.hf_max_new:
                        secs = run_hf(hf, prompts[b], new)
                        row.update(seconds=secs, tokens_per_s=b * new / secs,
                                   fraction_of_roofline=roof / secs)
                    else:
                        row["seconds"] = "not run"
                    save(row)
        del hf, state
        gc.collect()
        torch.cuda.empty_cache() if gpu else None
    write_results("rollout" + ("_smoke" if args.smoke else ""), args.out, info, rows, columns,
                  notes)

if __name__ == "__main__":
    main()

"""One DeepSeek-V4-Flash attention layer, forward + backward: transformers' eager attention
against `rl.models.v4_attention` (Triton forward with the Triton backward, with the per-block
torch recompute backward, and the chunked torch path), peak memory beyond weights and gradients,
and time, per sequence length; then the attention op alone (the core: window + compressed
entries + sink, no projections) with each backward. Both against the FLOP limit.

The layer is `DeepseekV4Attention` at the published Flash dims (hidden 4096, 64 heads x 512,
one K=V head, window 128, CSA rate 4 with the 64-head indexer's top-512, HCA rate 128), BF16,
one sequence, random weights. Memory is the peak over one forward + backward minus what was
allocated before it (weights, their gradients from a warm-up step, the input); eager's (S x S)
model-level mask is built inside the measured step, as the model does per forward. Out of
memory is recorded as a result. Left out: the MoE / hyper-connection rest of the decoder layer.

FLOPs: the layer's 6 x parameters x tokens (the indexer's included, as bench.v4_layer counts
it) plus the core's; the core, per query: the keys it sees (window, CSA picks or HCA's visible
entries) x heads x 4 x head_dim (QK^T and PV) x 3 for forward + backward (bench.v4_layer's
convention; a flash backward's recompute of QK^T is not counted), plus the CSA indexer's
forward scores. `limit_s` is that count at the bf16 matmul rate measured in the run
(`bench.common.measure_bf16_peak`); `of_limit` = limit_s / seconds (an MFU).
The core rows feed the op random inputs of the layer's shapes (CSA: distinct random causal
picks; HCA: every visible entry); `fwd_seconds` is its forward alone.

Run: python -m bench.v4_attention [--tokens 4096 8192 16384 18432] [--layer csa|hca|sliding]
     [--impl eager triton triton_one_pass triton_torch_bwd torch triton_torch_indexer]
     [--core triton triton_one_pass triton_torch_bwd]
"""
from __future__ import annotations

import gc
import statistics
import time

import torch

from bench.common import device_info, measure_bf16_peak, parse_args, sync, write_results

GiB = 2 ** 30
FLASH = dict(vocab_size=1024, hidden_size=4096, num_attention_heads=64, num_key_value_heads=1,
             head_dim=512, q_lora_rank=1024, qk_rope_head_dim=64, o_groups=8, o_lora_rank=1024,
             index_n_heads=64, index_head_dim=128, index_topk=512, sliding_window=128,
             moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2,
             compress_rope_theta=160000, max_position_embeddings=1048576,
             rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                           "beta_fast": 32, "beta_slow": 1})
LAYERS = {"sliding": 0, "csa": 1, "hca": 2}
IMPLS = {"triton": ("triton", "triton"), "triton_one_pass": ("triton", "triton_one_pass"),
         "triton_torch_bwd": ("triton", "torch"), "torch": ("torch", "triton")}
"""impl -> (kernel.FORCE, kernel.BACKWARD); eager is transformers' attention."""
LAYER_IMPLS = [*IMPLS, "triton_torch_indexer"]
"""Layer rows also compare the Triton path with the indexer scored in torch (RL_V4_INDEXER)."""


def v4_config(**fields):
    """A 3-layer V4 config (sliding, CSA, HCA) with Flash's attention dims unless overridden."""
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    dims = {**FLASH, **fields}
    dims.setdefault("compress_rates", {"compressed_sparse_attention": 4,
                                       "heavily_compressed_attention": 128})
    return DeepseekV4Config(
        num_hidden_layers=3, layer_types=["sliding_attention", "compressed_sparse_attention",
                                          "heavily_compressed_attention"],
        mlp_layer_types=["moe", "moe", "moe"], attn_implementation="eager", **dims)


def build_layer(config, layer: str, device, dtype=torch.bfloat16, seed: int = 0):
    """(attention module, rotary module) for `layer` in `dtype` (sinks fp32); sinks and
    position biases drawn N(0, 1) (their init is empty), the rest as transformers inits it."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4Attention, DeepseekV4RotaryEmbedding)
    torch.manual_seed(seed)
    with torch.device(device):
        attn = DeepseekV4Attention(config, LAYERS[layer])
        rotary = DeepseekV4RotaryEmbedding(config)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name.endswith(("sinks", "position_bias")):
                p.normal_(0, 1.0)
    for name, p in attn.named_parameters():  # the sinks stay fp32, as in a loaded checkpoint
        if not name.endswith("sinks"):
            p.data = p.data.to(dtype)
    return attn.train(), rotary


def run_layer(attn, rotary, hidden, impl: str):
    """Forward of `attn` on `hidden` (1, S, hidden) with `impl`: eager or one of IMPLS."""
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention

    from rl.models.v4_attention import compress, kernel
    from rl.models.v4_attention.module import LinearV4Attention
    seq = hidden.shape[1]
    pos = torch.arange(seq, device=hidden.device).unsqueeze(0)
    emb = {t: rotary(hidden, position_ids=pos, layer_type=t) for t in ("main", "compress")}
    if impl == "eager":
        attn.__class__ = DeepseekV4Attention
        attn.config._attn_implementation = "eager"
        mask = create_sliding_window_causal_mask(config=attn.config, inputs_embeds=hidden,
                                                 attention_mask=None, past_key_values=None,
                                                 position_ids=pos)
    else:
        attn.__class__ = LinearV4Attention
        kernel.FORCE, kernel.BACKWARD = IMPLS.get(impl, IMPLS["triton"])
        compress.INDEXER = "torch" if impl == "triton_torch_indexer" else ""
        mask = None
    return attn(hidden, emb, pos, mask)[0]


def _timed(step, reset, reps: int, cuda: bool) -> dict:
    """seconds (median of `reps` after a warm-up) and peak_gib of `step()`; OOM is a result."""
    row = {}
    try:
        step()  # warm-up (compiles, tunes, gradients exist)
        times = []
        for i in range(reps):
            reset()
            gc.collect()
            sync()
            if i == 0 and cuda:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)
            if i == 0 and cuda:
                row["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / GiB
        row["seconds"] = statistics.median(times)
        row["result"] = "ok"
    except torch.OutOfMemoryError:
        row["result"] = "OOM"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def measure(attn, rotary, seq: int, impl: str, reps: int) -> dict:
    """One layer forward + backward of `impl` over `seq` random tokens."""
    device = next(attn.parameters()).device
    hidden = torch.randn(1, seq, attn.config.hidden_size, device=device, dtype=torch.bfloat16,
                         requires_grad=True)
    grad = torch.randn_like(hidden)
    row = {"part": "layer", "tokens": seq, "impl": impl}
    row.update(_timed(lambda: run_layer(attn, rotary, hidden, impl).backward(grad),
                      lambda: setattr(hidden, "grad", None), reps, device.type == "cuda"))
    return row


def core_flops(config, layer: str, seq: int, indexer: bool) -> float:
    """Attention-core FLOPs of one forward + backward over `seq` tokens (module docstring)."""
    i = torch.arange(seq, dtype=torch.float64)
    keys = (i + 1).clamp(max=config.sliding_window)
    extra = 0.0
    if layer != "sliding":
        kind = {"csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention"}
        visible = torch.div(i + 1, config.compress_rates[kind[layer]], rounding_mode="floor")
        if layer == "csa":
            keys = keys + visible.clamp(max=config.index_topk)
            if indexer:
                extra = 2.0 * config.index_n_heads * config.index_head_dim * visible.sum().item()
        else:
            keys = keys + visible
    heads, dim = config.num_attention_heads, config.head_dim
    return 3 * 4 * heads * dim * keys.sum().item() + extra


def core_inputs(config, layer: str, seq: int, device) -> dict:
    """Random bf16 inputs of the attention op at the layer's shapes (module docstring)."""
    g = torch.Generator(device=device).manual_seed(seq)
    heads, dim = config.num_attention_heads, config.head_dim

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=g)
    case = dict(q=randn(1, seq, heads, dim).transpose(1, 2), kv=randn(1, seq, dim),
                grad=randn(1, seq, heads, dim).transpose(1, 2), comp=None, topk=None, thr=None,
                sinks=torch.randn(heads, device=device, generator=g))
    if layer != "sliding":
        kind = {"csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention"}
        rate = config.compress_rates[kind[layer]]
        case["comp"] = randn(1, seq // rate, dim)
        thr = ((torch.arange(seq, device=device) + 1) // rate).unsqueeze(0)
        if layer == "hca":
            case["thr"] = thr
        else:
            scores = torch.rand(1, seq, seq // rate, device=device, generator=g)
            entry = torch.arange(seq // rate, device=device)
            scores = scores.masked_fill(entry >= thr.unsqueeze(-1), -1.0)
            picks = scores.topk(min(config.index_topk, seq // rate), dim=-1).indices
            case["topk"] = torch.where(picks >= thr.unsqueeze(-1), -1, picks)
    for name in ("q", "kv", "comp", "sinks"):
        if case[name] is not None:
            case[name].requires_grad_()
    return case


def measure_core(config, layer: str, seq: int, impl: str, reps: int, device) -> dict:
    """The attention op alone, forward + backward (and forward alone) with `impl`."""
    from rl.models.v4_attention import kernel
    kernel.FORCE, kernel.BACKWARD = IMPLS[impl]
    row = {"part": "core", "tokens": seq, "impl": impl}
    cuda = torch.device(device).type == "cuda"
    try:
        case = core_inputs(config, layer, seq, device)
    except torch.OutOfMemoryError:
        return {**row, "result": "OOM"}
    leaves = [case[n] for n in ("q", "kv", "comp", "sinks") if case[n] is not None]

    def forward():
        return kernel.attention(case["q"], case["kv"], case["comp"], case["topk"], case["thr"],
                                None, case["sinks"], config.head_dim ** -0.5,
                                config.sliding_window)

    def reset():
        for t in leaves:
            t.grad = None
    row.update(_timed(lambda: forward().backward(case["grad"]), reset, reps, cuda))
    if row["result"] == "ok":
        row["fwd_seconds"] = _timed(forward, reset, reps, cuda).get("seconds")
    return row


CSA_TARGET_S = 0.08
"""Issue 40: one V4-Flash CSA layer forward + backward at 18,432 tokens (H200; an H100 has the
same bf16 compute)."""


def targets(rows: list[dict], layer: str = "csa") -> list[str]:
    get = {(r["part"], r["tokens"], r["impl"]): r for r in rows}
    notes = []
    longest = get.get(("layer", 18432, "triton"))
    if longest:
        ok = longest["result"] == "ok"
        notes.append(f"target 18,432 tokens trains forward + backward: {'MET' if ok else 'NOT MET'}"
                     f" ({longest['result']})")
        if ok and layer == "csa":
            met = "MET" if longest["seconds"] <= CSA_TARGET_S else "NOT MET"
            notes.append(f"target CSA layer forward + backward at 18,432 tokens <= "
                         f"{CSA_TARGET_S} s: {met} ({longest['seconds'] * 1e3:.1f} ms)")
    eager, ours = get.get(("layer", 8192, "eager")), get.get(("layer", 8192, "triton"))
    if eager and ours and "ok" == eager["result"] == ours["result"]:
        frac = ours["peak_gib"] / eager["peak_gib"]
        met = "MET" if frac < 0.1 else "NOT MET"
        notes.append(f"target memory at 8,192 < 10% of eager's: {met} "
                     f"({ours['peak_gib']:.2f} vs {eager['peak_gib']:.2f} GiB, {frac:.1%})")
        fast = ours["seconds"] <= eager["seconds"]
        notes.append(f"target no slower than eager at 8,192: {'MET' if fast else 'NOT MET'} "
                     f"({ours['seconds'] * 1e3:.0f} vs {eager['seconds'] * 1e3:.0f} ms)")
    elif eager or ours:
        notes.append("targets at 8,192 not decided: eager or ours did not run there")
    return notes + _backward_targets(get)


def _backward_targets(get: dict) -> list[str]:
    notes = []
    for what, part, ours, other in (
            ("Triton backward faster than the torch recompute", "layer", "triton",
             "triton_torch_bwd"),
            ("Triton backward faster than the torch recompute", "core", "triton",
             "triton_torch_bwd"),
            ("two-pass Triton backward faster than the one-pass one", "layer", "triton",
             "triton_one_pass"),
            ("two-pass Triton backward faster than the one-pass one", "core", "triton",
             "triton_one_pass"),
            ("Triton indexer faster than its torch scores", "layer", "triton",
             "triton_torch_indexer")):
        new, old = get.get((part, 18432, ours)), get.get((part, 18432, other))
        if new and old and "ok" == new["result"] == old["result"]:
            met = "MET" if new["seconds"] < old["seconds"] else "NOT MET"
            notes.append(f"target {what}, {part} forward + backward at 18,432 tokens: {met} "
                         f"({new['seconds'] * 1e3:.1f} vs {old['seconds'] * 1e3:.1f} ms, "
                         f"{old['seconds'] / new['seconds']:.2f}x)")
    for impl in ("triton", "triton_one_pass"):
        core = get.get(("core", 18432, impl))
        if not core or core["result"] != "ok":
            continue
        met = "MET" if core["of_limit"] >= 0.35 else "NOT MET"
        bwd = core["seconds"] - core["fwd_seconds"]
        notes.append(f"target attention core forward + backward at 18,432 tokens >= 35% of its "
                     f"FLOP limit (the project's MFU bar), {impl}: {met} ({core['of_limit']:.1%}: "
                     f"{core['seconds'] * 1e3:.1f} ms vs {core['limit_s'] * 1e3:.1f} ms; forward "
                     f"{core['fwd_seconds'] * 1e3:.1f} ms, backward {bwd * 1e3:.1f} ms)")
    return notes


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], lambda p: (
        p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 18432]),
        p.add_argument("--impl", nargs="+", default=["eager", *LAYER_IMPLS],
                       choices=["eager", *LAYER_IMPLS]),
        p.add_argument("--core", nargs="*", choices=list(IMPLS),
                       default=["triton", "triton_one_pass", "triton_torch_bwd"]),
        p.add_argument("--layer", default="csa", choices=sorted(LAYERS)),
        p.add_argument("--reps", type=int, default=3)))
    if args.smoke:  # tiny CPU check of the script itself
        config, device = v4_config(hidden_size=64, num_attention_heads=4, head_dim=64,
                                   q_lora_rank=32, qk_rope_head_dim=16, o_groups=2,
                                   o_lora_rank=16, index_n_heads=4, index_head_dim=32,
                                   index_topk=4, sliding_window=8), "cpu"
        args.tokens, args.impl, args.core, args.reps = [64], ["eager", "torch"], ["torch"], 1
    else:
        config, device = v4_config(), "cuda"
    peak = measure_bf16_peak(device, 256 if args.smoke else 8192)  # TFLOP/s
    attn, rotary = build_layer(config, args.layer, device)
    params = sum(p.numel() for p in attn.parameters())
    rows = []
    for seq in args.tokens:
        layer_limit = (6.0 * params * seq + core_flops(config, args.layer, seq, True)) / peak
        for impl in args.impl:
            rows.append(_of_limit(measure(attn, rotary, seq, impl, args.reps), layer_limit))
            print(rows[-1], flush=True)
        core_limit = core_flops(config, args.layer, seq, False) / peak
        for impl in args.core:
            rows.append(_of_limit(measure_core(config, args.layer, seq, impl, args.reps, device),
                                  core_limit))
            print(rows[-1], flush=True)
    info = {**device_info(), "layer": args.layer, "layer_params": params,
            "bf16_peak_TFLOPs": peak, "backward_tiles": {part: _tiles("triton_bwd2", attr)
                               for part, attr in (("scores", "SCORES"), ("grads", "GRADS"))},
            "one_pass_backward_tiles": _tiles("triton_bwd", "TILES")}
    write_results("v4_attention_smoke" if args.smoke else "v4_attention", args.out, info, rows,
                  ["part", "tokens", "impl", "result", "peak_gib", "seconds", "fwd_seconds",
                   "limit_s", "of_limit"], _notes(args, params, peak) + targets(rows, args.layer))


def _of_limit(row: dict, limit_tflop: float) -> dict:
    row["limit_s"] = limit_tflop / 1e12
    if row["result"] == "ok":
        row["of_limit"] = row["limit_s"] / row["seconds"]
    return row


def _tiles(module: str, attr: str) -> dict:
    # one backward kernel's tiles (`triton_bwd.Tiles`) per (head_dim, padded heads, dtype), and
    # what each candidate took
    import sys
    mod = sys.modules.get(f"rl.models.v4_attention.{module}")
    if mod is None:
        return {}
    tiles = getattr(mod, attr)
    return {str(k): {"tiles": v, "ms": {str(c): t for c, t in tiles.timings.get(k, {}).items()}}
            for k, v in tiles.tuned.items()}


def _notes(args, params: int, peak: float) -> list[str]:
    return [f"one {args.layer.upper()} DeepseekV4Attention, {params / 1e6:.0f}M params, BF16, "
            "batch 1; peak_gib = peak allocated during one forward + backward minus what was "
            "allocated before (weights, gradients, input)",
            "layer rows: triton = rl.models.v4_attention on GPU as the trainer runs it (Triton "
            "forward, two-pass Triton backward: scores once per token into buffers, then the "
            "gradients); triton_one_pass = the same with RL_V4_ATTENTION_BWD=triton_one_pass "
            "(the scores recomputed in each D / DV program); triton_torch_bwd = the same with "
            "RL_V4_ATTENTION_BWD=torch (backward recomputing each query block in torch); triton_torch_indexer = "
            "triton with the CSA indexer's scores in torch (RL_V4_INDEXER=torch: per-head "
            "scores materialised a query block at a time), where triton scores them in one "
            "Triton pass (rl.models.v4_attention.triton_indexer); torch = its chunked CPU "
            "path run on the GPU; eager = transformers' attention",
            "core rows: the attention op alone (kernel.attention: sliding window + compressed "
            "entries + sink) on random inputs of the layer's shapes; fwd_seconds its forward "
            "alone",
            f"limit_s: the FLOPs (module docstring) at the bf16 matmul rate measured in this run, "
            f"{peak:,.4g} TFLOP/s; of_limit = limit_s / seconds"]


if __name__ == "__main__":
    main()

"""One DeepSeek-V4-Flash attention layer, forward + backward: transformers' eager attention
against `rl.models.v4_attention` (Triton forward + per-block recompute backward, and the
chunked torch path), peak memory beyond weights and gradients, and time, per sequence length.

The layer is `DeepseekV4Attention` at the published Flash dims (hidden 4096, 64 heads x 512,
one K=V head, window 128, CSA rate 4 with the 64-head indexer's top-512, HCA rate 128), BF16,
one sequence, random weights. Memory is the peak over one forward + backward minus what was
allocated before it (weights, their gradients from a warm-up step, the input); eager's (S x S)
model-level mask is built inside the measured step, as the model does per forward. Out of
memory is recorded as a result. Left out: the MoE / hyper-connection rest of the decoder layer.

Run: python -m bench.v4_attention [--tokens 4096 8192 16384 18432] [--layer csa|hca]
"""
from __future__ import annotations

import gc
import statistics
import time

import torch

from bench.common import device_info, parse_args, sync, write_results

GiB = 2 ** 30
FLASH = dict(vocab_size=1024, hidden_size=4096, num_attention_heads=64, num_key_value_heads=1,
             head_dim=512, q_lora_rank=1024, qk_rope_head_dim=64, o_groups=8, o_lora_rank=1024,
             index_n_heads=64, index_head_dim=128, index_topk=512, sliding_window=128,
             moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2,
             compress_rope_theta=160000, max_position_embeddings=1048576,
             rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                           "beta_fast": 32, "beta_slow": 1})
LAYERS = {"sliding": 0, "csa": 1, "hca": 2}


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
    """Forward of `attn` on `hidden` (1, S, hidden) with `impl` in eager / triton / torch."""
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention

    from rl.models.v4_attention import kernel
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
        kernel.FORCE = impl
        mask = None
    return attn(hidden, emb, pos, mask)[0]


def measure(attn, rotary, seq: int, impl: str, reps: int) -> dict:
    device = next(attn.parameters()).device
    hidden = torch.randn(1, seq, attn.config.hidden_size, device=device, dtype=torch.bfloat16,
                         requires_grad=True)
    grad = torch.randn_like(hidden)
    row = {"tokens": seq, "impl": impl}
    cuda = device.type == "cuda"
    try:
        run_layer(attn, rotary, hidden, impl).backward(grad)  # warm-up (compiles, grads exist)
        times = []
        for i in range(reps):
            hidden.grad = None
            gc.collect()
            sync()
            if i == 0 and cuda:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            run_layer(attn, rotary, hidden, impl).backward(grad)
            sync()
            times.append(time.perf_counter() - t0)
            if i == 0 and cuda:
                row["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / GiB
        row["seconds"] = statistics.median(times)
        row["result"] = "ok"
    except torch.OutOfMemoryError:
        row["result"] = "OOM"
    hidden = grad = None
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def targets(rows: list[dict]) -> list[str]:
    get = {(r["tokens"], r["impl"]): r for r in rows}
    notes = []
    longest = get.get((18432, "triton"))
    if longest:
        ok = longest["result"] == "ok"
        notes.append(f"target 18,432 tokens trains forward + backward: {'MET' if ok else 'NOT MET'}"
                     f" ({longest['result']})")
    eager, ours = get.get((8192, "eager")), get.get((8192, "triton"))
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
    return notes


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], lambda p: (
        p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 18432]),
        p.add_argument("--impl", nargs="+", default=["eager", "triton", "torch"]),
        p.add_argument("--layer", default="csa", choices=sorted(LAYERS)),
        p.add_argument("--reps", type=int, default=3)))
    if args.smoke:  # tiny CPU check of the script itself
        config, device = v4_config(hidden_size=64, num_attention_heads=4, head_dim=64,
                                   q_lora_rank=32, qk_rope_head_dim=16, o_groups=2,
                                   o_lora_rank=16, index_n_heads=4, index_head_dim=32,
                                   index_topk=4, sliding_window=8), "cpu"
        args.tokens, args.impl, args.reps = [64], ["eager", "torch"], 1
    else:
        config, device = v4_config(), "cuda"
    attn, rotary = build_layer(config, args.layer, device)
    params = sum(p.numel() for p in attn.parameters())
    rows = []
    for seq in args.tokens:
        for impl in args.impl:
            row = measure(attn, rotary, seq, impl, args.reps)
            print(row, flush=True)
            rows.append(row)
    info = {**device_info(), "layer": args.layer, "layer_params": params}
    notes = [f"one {args.layer.upper()} DeepseekV4Attention, {params / 1e6:.0f}M params, BF16, "
             "batch 1; peak_gib = peak allocated during one forward + backward minus what was "
             "allocated before (weights, gradients, input)",
             "triton = rl.models.v4_attention on GPU (Triton forward, backward recomputing each "
             "query block in torch); torch = its chunked CPU path run on the GPU"] + targets(rows)
    write_results("v4_attention_smoke" if args.smoke else "v4_attention", args.out, info, rows,
                  ["tokens", "impl", "result", "peak_gib", "seconds"], notes)


if __name__ == "__main__":
    main()

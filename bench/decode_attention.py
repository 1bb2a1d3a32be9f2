"""The native engine's decode attention kernel alone (issue 16): BF16 vs FP8 KV cache, over its
tile (BLOCK_L), Triton's warps and pipeline stages, the FP8 kernel's products (QK and PV in e4m3
or in fp16 after conversion) and split-K, against the copy bandwidth measured in the same run.

    python -m bench.decode_attention [--shapes 256x1024,64x1024,16x4096]

Qwen3-0.6B's attention (16 query heads, 8 KV heads, head_dim 128), one query per row over a
`ctx`-slot cache (rows x ctx), random q and caches; the FP8 cache is `quantize_kv` of the BF16
one. Per variant: microseconds per call (`triton.testing.do_bench_cudagraph`, median: replayed
from a CUDA graph as the engine runs it, so Triton's launch cost on the host, 20-40 us a launch,
is not timed; plain `do_bench` had the same kernel at 55 and 64 us in one run), the KV bytes one
call reads (K and V, plus the FP8 scale exponents) / that time, as a fraction of the measured
copy bandwidth, and the largest absolute difference from the fp32 torch reference over the same
cache. `engine_default` marks what the engine runs (`rl.rollout.native.model.attention_settings`).
`--smoke`: tiny shapes in fp32 under the Triton interpreter on the CPU.
"""
from __future__ import annotations

import os

import torch

from bench.common import device_info, measure_copy_bandwidth, parse_args, write_results
from rl.plan.kv import KV_FP8_SCALE_BYTES, gqa_bytes_per_token

NH, NKV, D = 16, 8, 128
MMA = ((True, True), (True, False), (False, False))   # FP8 kernel: (QK, PV) products in e4m3


def variants(rows: int, ctx: int) -> list[dict]:
    """The kernel settings compared at one shape."""
    from rl.rollout.native.kernels import decode_splits
    out = [dict(kv="bf16", block_l=b, num_warps=None, fp8_mma=None, splits=1, num_stages=None)
           for b in (32, 64, 128)]
    for mma in MMA:
        for b in (64, 128):
            for w in (None, 8):
                out.append(dict(kv="fp8", block_l=b, num_warps=w, fp8_mma=mma, splits=1,
                                num_stages=None))
    out += [dict(kv="fp8", block_l=b, num_warps=w, fp8_mma=MMA[0], splits=1, num_stages=st)
            for b, w, st in ((128, None, 2), (128, None, 3), (128, None, 4), (256, None, 2),
                             (256, 8, 2))]
    auto = decode_splits(rows, NKV, ctx, 64)
    if auto > 1:
        out += [dict(kv="bf16", block_l=64, num_warps=None, fp8_mma=None, splits=auto,
                     num_stages=None)]
        out += [dict(kv="fp8", block_l=b, num_warps=None, fp8_mma=mma, splits=auto,
                     num_stages=None) for b in (64, 128) for mma in (MMA[0], MMA[2])]
    # Forced splits: with one program per (row, kv head), 2,048 equal programs at 256 rows
    # make 5.2 waves at 3 resident per SM, a sixth wave one fifth full; do splits (more, shorter
    # programs and a combine kernel) recover that tail? (H200: no, 154 / 167 us vs 151.)
    out += [dict(kv=kv, block_l=b, num_warps=None, fp8_mma=MMA[0] if kv == "fp8" else None,
                 splits=s, num_stages=None)
            for kv, b in (("bf16", 64), ("fp8", 128)) for s in (2, 3) if s != auto]
    # an FP8 cache holds whole tiles (KVCache pads rows to 128 slots)
    return [v for v in out if v["kv"] == "bf16" or ctx % v["block_l"] == 0]


def engine_variant(kv: str, splits: int) -> dict:
    """The variant the native engine runs (`rl.rollout.native.model.attention_settings`)."""
    from rl.rollout.native.model import attention_settings
    settings = dict(block_l=64, num_warps=None, num_stages=None,
                    fp8_mma=(True, True) if kv == "fp8" else None)   # H200: e4m3 products
    settings.update(attention_settings(kv == "fp8"))
    return dict(kv=kv, splits=splits, **settings)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], lambda p: p.add_argument(
        "--shapes", default="256x1024,64x1024,16x4096", help="rows x context, comma list"))
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    from rl.rollout.native import kernels as K
    from rl.rollout.native.kvcache import quantize_kv
    gpu = not args.smoke
    device = "cuda" if gpu else "cpu"
    shapes = [(4, 128)] if args.smoke else [tuple(int(x) for x in s.split("x"))
                                            for s in args.shapes.split(",")]
    bw = measure_copy_bandwidth(device, 2.0) * 1e9 if gpu else None
    if gpu:
        from triton.testing import do_bench_cudagraph
    rows_out = []
    for rows, ctx in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        dt = torch.bfloat16 if gpu else torch.float32   # the interpreter has no bf16 dot
        q = torch.randn(rows, NH, D, device=device, generator=g).to(dt)
        kc = torch.randn(rows, NKV, ctx, D, device=device, generator=g).to(dt)
        vc = torch.randn(rows, NKV, ctx, D, device=device, generator=g).to(dt)
        k8, ke = quantize_kv(kc)
        v8, ve = quantize_kv(vc)
        v8 = v8.transpose(-1, -2).contiguous()            # the FP8 cache's V layout: (D, L)
        start = torch.zeros(rows, dtype=torch.int32, device=device)
        pos = torch.tensor([ctx - 1], dtype=torch.int32, device=device)
        scale = D ** -0.5
        ref = {"bf16": K.decode_attention(q, kc, vc, start, pos, scale, "torch").float(),
               "fp8": K.decode_attention(q, k8, v8, start, pos, scale, "torch", k_exp=ke,
                                         v_exp=ve).float()}
        kv_bytes = {"bf16": rows * ctx * gqa_bytes_per_token(1, NKV, D, 2),
                    "fp8": rows * ctx * gqa_bytes_per_token(1, NKV, D, 1, KV_FP8_SCALE_BYTES)}
        for v in variants(rows, ctx):
            caches = (kc, vc, None, None) if v["kv"] == "bf16" else (k8, v8, ke, ve)

            def call():
                return K.decode_attention(q, caches[0], caches[1], start, pos, scale, "triton",
                                          v["block_l"], caches[2], caches[3],
                                          splits=v["splits"], fp8_mma=v["fp8_mma"],
                                          num_warps=v["num_warps"],
                                          num_stages=v["num_stages"])
            err = (call().float() - ref[v["kv"]]).abs().max().item()
            us = do_bench_cudagraph(call, rep=200) * 1e3 if gpu else None
            default = v == engine_variant(v["kv"], v["splits"])
            rows_out.append({
                "shape": f"{rows} x {ctx}", "kv": v["kv"], "block_l": v["block_l"],
                "num_warps": v["num_warps"] or "default",
                "num_stages": v["num_stages"] or ("auto" if v["kv"] == "fp8" else "default"),
                "products": "bf16" if v["kv"] == "bf16" else "QK {} PV {}".format(
                    *("e4m3" if x else "fp16" for x in v["fp8_mma"])),
                "splits": v["splits"], "engine_default": "yes" if default else "",
                "us": us, "GBps": kv_bytes[v["kv"]] / us / 1e3 if us else None,
                "of_copy_bw": kv_bytes[v["kv"]] / us * 1e6 / bw if us else None,
                "max_abs_err": err})
            print(rows_out[-1], flush=True)
    notes = [f"Qwen3-0.6B attention: {NH} query heads, {NKV} KV heads, head_dim {D}; one query "
             "per row over the whole cache; random bf16 q and caches, FP8 = quantize_kv of them",
             "us: triton.testing.do_bench_cudagraph median (200 ms of graph replays); GBps: KV "
             "bytes one call reads (K + V, FP8: + one scale exponent byte per slot and head) / us",
             f"copy bandwidth measured in this run: {bw / 1e9:,.0f} GB/s (read + write)" if bw
             else "smoke: Triton interpreter on CPU, no timing",
             "max_abs_err: against the fp32 torch reference over the same (BF16 or FP8) cache",
             "engine_default: what the native engine runs at that cache dtype and split count "
             "(rl.rollout.native.model.attention_settings)",
             "num_stages auto (FP8 cache): kernels.fp8_attention_stages, 2 for a single pass "
             "of at least 2 programs per SM, else 3 (Triton's default)"]
    write_results("decode_attention" + ("_smoke" if args.smoke else ""), args.out,
                  device_info(), rows_out, list(rows_out[0]), notes)


if __name__ == "__main__":
    main()

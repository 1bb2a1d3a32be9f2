"""The decode GEMMs of the native engine, FP8 against BF16: which FP8 path can pay (issue 16).

At decode every linear is a skinny GEMM (M = batch rows, K and N the model's), bound by reading
the weight. FP8 halves those bytes, so its ceiling is ~2x BF16's at small M; at Qwen3-0.6B's shapes
every GEMM sits near a latency floor instead (BF16: 5-8 us against 1-3 us of weight reads;
Qwen3-4B's are larger). This measures, per shape, side by side in one run:
- `bf16`: F.linear on the BF16 weight (cuBLAS), the BF16 engine's path;
- `w8a16 (ours)`: `rl.rollout.native.kernels.w8a16_linear`, the FP8 engine's Triton kernel
  (e4m3 weight with 128x128 block scales, dequantised in the kernel, BF16 activations);
- `w8a8 _scaled_mm`: cuBLAS FP8 GEMM via `torch._scaled_mm`, weight rowwise-scaled e4m3 and
  activations quantised per token (the quantisation kernel is timed with it: `+quant`);
- `w8a8 block`: `rl.rollout.native.kernels.w8a8_linear`, the engine's block-FP8 weight as it is
  (128x128 scales) times activations in 1x128 blocks, cuBLAS's DeepSeek-style block-scaled
  GEMM; `w8a8 block` alone on pre-quantised activations, `+quant` with our Triton quantiser;
- `w8a8 triton`: `kernels.w8a8_triton`, the same block-scaled product in our Triton kernel
  (TMA-fed, pipelined, split-K for narrow outputs), default tiles and the best of a small sweep;
- `engine`: the kernel the FP8 engine's "auto" takes at that shape (`model.w8a8_kernel`) and
  its time as the engine runs it (o / down split over K: the partials plus the RMSNorm's extra
  reads);
- the roofline: weight bytes / measured HBM copy bandwidth (what a weight-bound GEMM can reach).
Times: 64 calls captured in one CUDA graph (as the engine's decode runs them; no launch
latency), median over replays; the weights rotate through 16 copies (more than L2 holds) so
each call reads HBM.
Qwen3-0.6B and Qwen3-4B decode shapes (qkv, o, gate_up, down; the engine fuses qkv and
gate+up) at M = 64 and 256, and a Qwen3-30B-A3B-sized dense row for scale.

`--sweep`: also time `w8a16_linear` over its launch settings (tile BM x BN x BK, K splits,
warps, stages) per shape and report the fastest next to the default (`w8a16 best us`,
`best tiles`): what the engine's tile choice should be, by measurement.

Run: python -m bench.fp8_gemm [--m 64 256] [--sweep]
"""
from __future__ import annotations

import itertools
import statistics

import torch
import torch.nn.functional as F

from bench.common import (QWEN3_06B, QWEN3_4B, device_info, measure_copy_bandwidth, parse_args,
                          write_results)
from rl.quant.block_fp8 import quantize_act_group
from rl.quant.fast_quant import quantize_act_fast
from rl.rollout.native.model import w8a8_kernel


def shapes(fields: dict) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of one decoder layer's linears, as the native engine fuses them."""
    h, hd = fields["hidden_size"], fields["head_dim"]
    nh, nkv, i = fields["num_attention_heads"], fields["num_key_value_heads"], \
        fields["intermediate_size"]
    return {"qkv": ((nh + 2 * nkv) * hd, h), "o": (h, nh * hd), "gate_up": (2 * i, h),
            "down": (h, i)}


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 and its fp32 scale (M, 1): the project's activation quantiser with one
    group per row."""
    return quantize_act_group(x, group=x.shape[1])


def time_cuda(fn, reps: int = 64, iters: int = 20) -> float:
    """Median GPU seconds of one call: `reps` calls captured in one CUDA graph (as the engine's
    decode step runs them), so launch latency is not measured; median over `iters` replays."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / reps)
    return statistics.median(times)


def sweep_configs(m: int, k: int) -> list[dict]:
    """The w8a16 launch settings `--sweep` tries at M = m (BM <= the next power of two of m)."""
    bms = [b for b in (16, 32, 64, 128) if b <= max(16, 1 << (m - 1).bit_length())]
    splits = sorted({1, 2, 4, 8} & set(range(1, k // 128 + 1)))
    return [dict(BM=bm, BN=bn, BK=bk, split=sp, num_warps=nw, num_stages=ns)
            for bm, bn, bk, sp, nw, ns in itertools.product(bms, (32, 64, 128), (64, 128), splits,
                                                            (4, 8), (3, 4))]


def sweep(x, wq, ws, rot, it) -> tuple[float, dict]:
    """(fastest seconds, its settings) of the Triton w8a16_linear over `sweep_configs`."""
    from rl.rollout.native import kernels as K
    best = (float("inf"), {})
    for cfg in sweep_configs(x.shape[0], x.shape[1]):
        try:
            t = time_cuda(lambda: K.w8a16_linear(x, wq[(j := next(it) % rot)], ws[j],
                                                 impl="triton", tiles=cfg), reps=32, iters=8)
        except Exception:  # noqa: BLE001 - a setting Triton cannot compile (shared memory)
            continue
        best = min(best, (t, cfg), key=lambda b: b[0])
    return best


def case(m: int, n: int, k: int, device: str, smoke: bool, do_sweep: bool = False,
         feeds_norm: bool = False) -> dict[str, float | None]:
    from rl.quant.block_fp8 import quantize_weight_block
    from rl.rollout.native import kernels as K
    torch.manual_seed(0)
    rot = 1 if smoke else 16  # rotate through copies so each call reads its weight from HBM
    w = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5 for _ in range(rot)]
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    blocks = [quantize_weight_block(wi) for wi in w]
    wq = [q.view(torch.uint8) for q, _ in blocks]
    ws = [s for _, s in blocks]
    it = iter(range(10 ** 9))
    out: dict[str, float | None] = {}
    impl = "torch" if smoke else "triton"
    ref = F.linear(x, w[0]).float()
    got = K.w8a16_linear(x, wq[0], ws[0], impl=impl).float()
    out["w8a16_rel_err"] = ((got - ref).norm() / ref.norm()).item()
    if smoke:  # no timing on the CPU, so no sweep either
        return out
    if do_sweep:
        out["w8a16_best"], out["best_tiles"] = sweep(x, wq, ws, rot, it)
    out["bf16"] = time_cuda(lambda: F.linear(x, w[next(it) % rot]))
    out["w8a16"] = time_cuda(lambda: K.w8a16_linear(x, wq[(j := next(it) % rot)], ws[j],
                                                    impl="triton"))
    # cuBLAS FP8: rowwise weight scales (N,) and per-token activation scales (M,)
    rows = [quant_rows(wi) for wi in w]
    wt = [q.t() for q, _ in rows]          # (K, N) column-major view, what _scaled_mm wants
    sw = [s.t().contiguous() for _, s in rows]  # (1, N)
    try:
        xq, sx = quant_rows(x)
        y = torch._scaled_mm(xq, wt[0], scale_a=sx, scale_b=sw[0], out_dtype=torch.bfloat16)
        out["w8a8_rel_err"] = ((y.float() - ref).norm() / ref.norm()).item()
        out["w8a8"] = time_cuda(lambda: torch._scaled_mm(
            xq, wt[(j := next(it) % rot)], scale_a=sx, scale_b=sw[j], out_dtype=torch.bfloat16))

        def quant_and_mm():
            j = next(it) % rot
            q, s = quant_rows(x)
            return torch._scaled_mm(q, wt[j], scale_a=s, scale_b=sw[j], out_dtype=torch.bfloat16)
        out["w8a8_quant"] = time_cuda(quant_and_mm)
    except (RuntimeError, TypeError) as e:  # an unsupported scaling mode is a result
        out["w8a8_error"] = str(e).splitlines()[0][:120]
    if K.w8a8_supported(n, k, x.device):
        got = K.w8a8_linear(x, wq[0], ws[0], impl="triton").float()
        out["w8a8_block_rel_err"] = ((got - ref).norm() / ref.norm()).item()
        emu = K.w8a8_linear(x, wq[0], ws[0], impl="torch").float()
        out["w8a8_block_vs_emulation"] = ((got - emu).norm() / emu.norm()).item()
        xq8 = quantize_act_fast(x, 4)
        out["w8a8_block"] = time_cuda(lambda: K.w8a8_linear(
            xq8, wq[(j := next(it) % rot)], ws[j], impl="triton"))
        out["w8a8_block_quant"] = time_cuda(lambda: K.w8a8_linear(
            x, wq[(j := next(it) % rot)], ws[j], impl="triton"))
        out["act_quant"] = time_cuda(lambda: quantize_act_fast(x, 4))
        # our Triton W8A8 kernel on the same quantised operands: default tiles, then the
        # fastest of a small sweep (BN x split x stages; the engine's choice is set from it)
        tri = K.w8a8_triton(xq8, wq[0], ws[0]).float()
        out["w8a8_triton_vs_emulation"] = ((tri - emu).norm() / emu.norm()).item()
        out["w8a8_triton"] = time_cuda(lambda: K.w8a8_triton(
            xq8, wq[(j := next(it) % rot)], ws[j]))
        best = (float("inf"), {})
        for bn, sp, st in itertools.product((64, 128), (1, 2, 3, 4, 6, 8, 12), (3, 4)):
            cfg = dict(BN=bn, split=sp, num_stages=st)
            t = time_cuda(lambda: K.w8a8_triton(xq8, wq[(j := next(it) % rot)], ws[j],
                                                 tiles=cfg), reps=32, iters=8)
            best = min(best, (t, cfg), key=lambda b: b[0])
        out["w8a8_triton_best"], out["w8a8_triton_tiles"] = best
        if feeds_norm:   # o / down at decode: split-K partials summed by the RMSNorm after
            part = K.w8a8_triton(xq8, wq[0], ws[0], partial=True)
            if isinstance(part, K.Partials):
                out["splits"] = part.parts.shape[0]
                out["w8a8_triton_partial"] = time_cuda(lambda: K.w8a8_triton(
                    xq8, wq[(j := next(it) % rot)], ws[j], partial=True))
                res, wn = torch.randn_like(tri).bfloat16(), torch.ones(n, device=device,
                                                                       dtype=torch.bfloat16)
                summed = part.sum()
                out["norm_partials_extra"] = (
                    time_cuda(lambda: K.rmsnorm(part, wn, 1e-6, res, "triton", quant=True))
                    - time_cuda(lambda: K.rmsnorm(summed, wn, 1e-6, res, "triton", quant=True)))
    return out


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], lambda p: (
        p.add_argument("--m", type=int, nargs="+", default=[64, 256]),
        p.add_argument("--sweep", action="store_true",
                       help="also sweep w8a16's launch settings per shape")))
    device = "cpu" if args.smoke else "cuda"
    fields = dict(QWEN3_06B, hidden_size=256, head_dim=64, intermediate_size=512,
                  num_attention_heads=4, num_key_value_heads=2) if args.smoke else QWEN3_06B
    per = shapes(fields)
    if not args.smoke:
        per.update({f"4B {key}": nk for key, nk in shapes(QWEN3_4B).items()})
        per["30B-A3B o (dense 4096x8192)"] = (4096, 8192)
    bw = None if args.smoke else measure_copy_bandwidth(device)
    rows = []
    for m in ([4] if args.smoke else args.m):
        for name, (n, k) in per.items():
            feeds_norm = name.split()[-1] in ("o", "down") or name.startswith("30B")
            r = case(m, n, k, device, args.smoke, args.sweep, feeds_norm=feeds_norm)
            row = {"shape": name, "M": m, "N": n, "K": k, **{
                f"{key} us": v * 1e6 for key, v in r.items()
                if key in ("bf16", "w8a16", "w8a16_best", "w8a8", "w8a8_quant", "w8a8_block",
                           "w8a8_block_quant", "act_quant", "w8a8_triton", "w8a8_triton_best",
                           "w8a8_triton_partial", "norm_partials_extra")
                and v is not None}}
            if "w8a8_triton_tiles" in r:
                row["w8a8 triton best tiles"] = " ".join(
                    f"{a}={b}" for a, b in r["w8a8_triton_tiles"].items())
            row["w8a8 triton vs emulation"] = r.get("w8a8_triton_vs_emulation")
            if "best_tiles" in r:
                row["best tiles"] = " ".join(f"{a}={b}" for a, b in r["best_tiles"].items())
            row["w8a16 err"] = r.get("w8a16_rel_err")
            row["w8a8 err"] = r.get("w8a8_rel_err")
            row["w8a8 block err"] = r.get("w8a8_block_rel_err")
            row["w8a8 block vs emulation"] = r.get("w8a8_block_vs_emulation")
            if bw:
                row["roofline bf16 us"] = n * k * 2 / (bw * 1e9) * 1e6
                row["roofline fp8 us"] = n * k / (bw * 1e9) * 1e6
                row["w8a16 / bf16"] = r["bf16"] / r["w8a16"]
                if "w8a16_best" in r:
                    row["w8a16 best / bf16"] = r["bf16"] / r["w8a16_best"]
                if "w8a8" in r:
                    row["w8a8 / bf16"] = r["bf16"] / r["w8a8"]
                    row["w8a8+quant / bf16"] = r["bf16"] / r["w8a8_quant"]
                if "w8a8_block" in r:
                    row["w8a8 block / bf16"] = r["bf16"] / r["w8a8_block"]
                    row["w8a8 block+quant / bf16"] = r["bf16"] / r["w8a8_block_quant"]
                if "w8a8_triton" in r:
                    row["w8a8 triton / bf16"] = r["bf16"] / r["w8a8_triton"]
                    row["w8a8 triton best / bf16"] = r["bf16"] / r["w8a8_triton_best"]
                if "w8a8_triton_partial" in r:
                    row["splits"] = r["splits"]
                    row["w8a8 triton partial+norm / bf16"] = r["bf16"] / (
                        r["w8a8_triton_partial"] + r["norm_partials_extra"])
            if bw and "w8a8_block" in r:
                gemm = w8a8_kernel(m, n, k, feeds_norm)
                row["engine"] = gemm
                row["engine us"] = 1e6 * (
                    r["w8a8_block"] if gemm == "cublas" else
                    r["w8a8_triton_partial"] + r["norm_partials_extra"]
                    if "w8a8_triton_partial" in r else r["w8a8_triton"])
                row["engine / bf16"] = r["bf16"] * 1e6 / row["engine us"]
            if "w8a8_error" in r:
                row["note"] = r["w8a8_error"]
            rows.append(row)
    cols = ["shape", "M", "N", "K", "bf16 us", "w8a16 us", "w8a16_best us", "w8a8 us",
            "w8a8_quant us", "w8a8_block us", "w8a8_block_quant us", "act_quant us",
            "w8a8_triton us", "w8a8_triton_best us", "w8a8 triton best tiles", "splits",
            "engine", "engine us", "engine / bf16",
            "w8a8_triton_partial us", "norm_partials_extra us",
            "roofline bf16 us", "roofline fp8 us", "w8a16 / bf16",
            "w8a16 best / bf16", "best tiles", "w8a8 / bf16",
            "w8a8+quant / bf16", "w8a8 block / bf16", "w8a8 block+quant / bf16",
            "w8a8 triton / bf16", "w8a8 triton best / bf16", "w8a8 triton partial+norm / bf16",
            "w8a16 err",
            "w8a8 err", "w8a8 block err", "w8a8 block vs emulation", "w8a8 triton vs emulation",
            "note"]
    notes = ["x / bf16 columns: speed-up over BF16 (>1 = FP8 faster); err: relative Frobenius "
             "error against the BF16 GEMM (FP8 rounding of weight, and for w8a8 of activations)",
             "w8a8: rowwise weight scales and per-token activation scales (cuBLAS / CUTLASS "
             "rowwise); w8a8 block: the engine's path, its 128x128 weight scales as they are and "
             "1x128 activation blocks (cuBLAS block-scaled); vs emulation: against the same "
             "quantised operands multiplied in fp32",
             "w8a8 triton: `kernels.w8a8_triton`, our kernel for the same block-scaled product "
             "(e4m3 x e4m3 tensor-core dots fed by TMA, scales applied per 128-wide K block, "
             "split-K for decode's narrow outputs) on pre-quantised activations; best: the "
             "fastest of BN in 64/128 x split 1/2/3/4/6/8/12 x 3/4 stages (summing its own "
             "partials)",
             "engine: the W8A8 kernel the FP8 engine's auto picks (`model.w8a8_kernel`) and its "
             "time as the engine runs it: cuBLAS = w8a8_block; ours on o / down split over K = "
             "w8a8_triton_partial + norm_partials_extra; else w8a8_triton",
             "w8a8_triton_partial: the same kernel (default tiles) leaving its `splits` split-K "
             "partials unsummed (`Partials`), as the engine runs o and down at decode; "
             "norm_partials_extra: what summing them costs the RMSNorm that reads them (its time "
             "on the partials minus its time on their bf16 sum, with residual and FP8 output); "
             "partial+norm / bf16: BF16's GEMM over those two (rows of GEMMs that feed an "
             "RMSNorm: hidden-sized outputs)"]
    if bw:
        notes.append(f"HBM copy bandwidth measured here: {bw:,.0f} GB/s")
    name = "fp8_gemm_sweep" if args.sweep else "fp8_gemm"
    write_results(f"{name}_smoke" if args.smoke else name, args.out, device_info(),
                  rows, cols, notes)


if __name__ == "__main__":
    main()

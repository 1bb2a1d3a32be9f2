"""The trainer's LM head on one GPU: forward + backward time and peak memory of the full-logits
path against the chunked path (`rl.trainer.lm_head`, `trainer.chunked_lm_head`), against the
physical limit, at DeepSeek-V4-Flash's head (vocabulary 129,280, hidden 4,096) in BF16.

Both paths compute what `TrainerWorker._micro_loss` needs from the final hidden states h (T, H)
and the head weight W (V, H): each token's log-prob with gradient, and its entropy as a detached
metric (`algorithm.entropy_coef: 0`, the shipped configs). Loss = sum of the log-probs times a
random per-token weight (a stand-in for the policy loss's gradient), backward to h and W.
- full: logits = h W^T (bf16, the model's nn.Linear), `losses.token_logprobs`, and
  `losses.entropy_from_logits` under no_grad, as the trainer ran before the chunked head;
- chunked: `rl.trainer.lm_head.chunked_logprobs` with `--chunk-rows` rows per chunk.

Limits: time = the GEMMs at the bf16 matmul rate measured in the same run
(`bench.common.measure_bf16_peak`): 3 of 2 T V H FLOPs each (the logits, then the gradients of h
and W); the chunked path recomputes the logits in backward, a 4th. Memory = h, W and their
gradients (what any path must hold); `over_GiB` is the peak allocated beyond them.

Targets: at 18,432 tokens the chunked path's peak is at most 2 GiB over h + W + gradients; at
every token count its time is within 1.3x of the full-logits path's.

Run: python -m bench.lm_head [--tokens 8192 18432] [--chunk-rows 1024] [--reps 5]
"""
from __future__ import annotations

import gc
import statistics
import time

import torch

from bench.common import device_info, measure_bf16_peak, parse_args, sync, write_results

GiB = 2 ** 30
VOCAB, HIDDEN = 129_280, 4_096  # rl/plan/known/DeepSeek-V4-Flash.json
TARGET_OVER_GIB, TARGET_TOKENS, TARGET_SLOWDOWN = 2.0, 18_432, 1.3
SMOKE = dict(vocab=512, hidden=64, tokens=[64, 128], chunk_rows=[16])


def _inputs(tokens: int, vocab: int, hidden: int, device: str):
    """Hidden states ~ N(0, 1) (what the final RMSNorm gives), a weight with N(0, 4/H) entries
    (logits ~ N(0, 4): a peaked next-token distribution), random targets and loss weights."""
    g = torch.Generator(device=device).manual_seed(tokens)
    h = torch.randn(1, tokens, hidden, device=device, generator=g).bfloat16()
    w = (torch.randn(vocab, hidden, device=device, generator=g) * 2 * hidden ** -0.5).bfloat16()
    targets = torch.randint(0, vocab, (1, tokens), device=device, generator=g)
    weights = torch.randn(1, tokens, device=device, generator=g)
    return h.requires_grad_(), w.requires_grad_(), targets, weights


def _step(path: str, h, w, targets, weights, chunk_rows: int) -> tuple[float, float]:
    """One forward + backward from zero gradients; (loss, mean entropy)."""
    from rl.trainer import losses
    from rl.trainer.lm_head import chunked_logprobs
    h.grad = w.grad = None
    if path == "full":
        logits = h @ w.t()
        logp = losses.token_logprobs(logits, targets)
        with torch.no_grad():
            ent = losses.entropy_from_logits(logits.detach())
        del logits
    else:
        logp, ent = chunked_logprobs(h, w, targets, 1.0, chunk_rows, entropy=True)
        ent = ent.detach()
    loss = (logp * weights).sum()
    loss.backward()
    return loss.item(), ent.mean().item()


def measure(path: str, tokens: int, vocab: int, hidden: int, chunk_rows: int, device: str,
            warmup: int, reps: int) -> dict:
    """Median seconds of `reps` steps after `warmup`, peak memory over h + W + gradients."""
    cuda = device == "cuda"
    h, w, targets, weights = _inputs(tokens, vocab, hidden, device)
    floor = 2 * (h.numel() + w.numel()) * 2  # h, W and their bf16 gradients
    row = {"tokens": tokens, "path": path, "chunk_rows": chunk_rows if path != "full" else None}
    try:
        for _ in range(warmup):
            _step(path, h, w, targets, weights, chunk_rows)
        gc.collect()
        if cuda:
            h.grad = w.grad = None
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            loss, ent = _step(path, h, w, targets, weights, chunk_rows)
            sync()
            times.append(time.perf_counter() - t0)
        row.update(result="ok", seconds=statistics.median(times), loss=loss, entropy=ent,
                   grad_h=h.grad.float().norm().item(), grad_w=w.grad.float().norm().item())
        if cuda:
            peak = torch.cuda.max_memory_allocated()
            row.update(peak_GiB=peak / GiB, over_GiB=(peak - floor) / GiB)
    except torch.OutOfMemoryError:
        row["result"] = "OOM"
    del h, w
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def notes_on(rows: list[dict], smoke: bool) -> list[str]:
    """Targets MET / NOT MET, and the paths' agreement, per token count."""
    notes, tag = [], " (smoke run: not a measurement)" if smoke else ""
    for tokens in sorted({r["tokens"] for r in rows}):
        at = [r for r in rows if r["tokens"] == tokens and r["result"] == "ok"]
        full = next((r for r in at if r["path"] == "full"), None)
        for r in (r for r in at if r["path"] == "chunked"):
            what = f"chunked ({r['chunk_rows']:,} rows) at {tokens:,} tokens"
            if full is None:
                notes.append(f"{what}: time target not decided, the full path did not run")
            else:
                ratio = r["seconds"] / full["seconds"]
                met = "MET" if ratio <= TARGET_SLOWDOWN else "NOT MET"
                notes.append(f"target time <= {TARGET_SLOWDOWN}x full logits, {what}: {met} "
                             f"({ratio:.2f}x){tag}")
                rel = abs(r["loss"] - full["loss"]) / max(abs(full["loss"]), 1e-12)
                notes.append(f"{what}: loss {r['loss']:.6g} vs full {full['loss']:.6g} (relative "
                             f"{rel:.1e}); |grad W| {r['grad_w']:.6g} vs {full['grad_w']:.6g}")
            if tokens == TARGET_TOKENS and "over_GiB" in r:
                met = "MET" if r["over_GiB"] <= TARGET_OVER_GIB else "NOT MET"
                notes.append(f"target memory <= {TARGET_OVER_GIB:g} GiB over h + W + gradients, "
                             f"{what}: {met} ({r['over_GiB']:.2f} GiB)")
    return notes


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], lambda p: (
        p.add_argument("--tokens", type=int, nargs="+", default=[8192, 18432]),
        p.add_argument("--chunk-rows", type=int, nargs="+", default=[1024]),
        p.add_argument("--warmup", type=int, default=2),
        p.add_argument("--reps", type=int, default=5)))
    vocab, hidden, device = VOCAB, HIDDEN, "cuda"
    if args.smoke:
        vocab, hidden, device = SMOKE["vocab"], SMOKE["hidden"], "cpu"
        args.tokens, args.chunk_rows, args.warmup, args.reps = (
            SMOKE["tokens"], SMOKE["chunk_rows"], 1, 2)
    elif not torch.cuda.is_available():
        raise SystemExit("bench.lm_head needs a CUDA GPU (or --smoke on CPU)")
    peak = measure_bf16_peak(device, 256 if args.smoke else 8192)  # TFLOP/s
    rows = []
    for tokens in args.tokens:
        gemm_s = 2.0 * tokens * vocab * hidden / (peak * 1e12)
        floor = 2 * (tokens + vocab) * hidden * 2  # h, W and their bf16 gradients
        rows.append({"tokens": tokens, "path": "limit", "result": "ok",
                     "seconds": 3 * gemm_s, "limit_s": 3 * gemm_s, "x_limit": 1.0,
                     "peak_GiB": floor / GiB if device == "cuda" else None,
                     "over_GiB": 0.0 if device == "cuda" else None})
        runs = [("full", args.chunk_rows[0])] + [("chunked", c) for c in args.chunk_rows]
        for path, chunk_rows in runs:
            row = measure(path, tokens, vocab, hidden, chunk_rows, device, args.warmup,
                          args.reps)
            row["limit_s"] = 3 * gemm_s
            if row["result"] == "ok":
                row["x_limit"] = row["seconds"] / row["limit_s"]
            print(row, flush=True)
            rows.append(row)
    info = {**device_info(), "bf16_peak_TFLOPs": peak, "vocab": vocab, "hidden": hidden,
            "dtype": "bfloat16", "warmup": args.warmup, "reps": args.reps}
    weights_gib = vocab * hidden * 2 / GiB
    notes = [f"head: vocab {vocab:,} x hidden {hidden:,} in bf16 ({weights_gib:.2f} GiB; "
             f"{'tiny smoke dims' if args.smoke else 'DeepSeek-V4-Flash'}), one sequence of "
             "`tokens` hidden states; step = forward + backward to h and W, log-probs with "
             "gradient, entropy as a detached metric",
             f"{args.reps} timed steps after {args.warmup} warm-up, median, synchronised; "
             "peak_GiB = max allocated over the timed steps; over_GiB = peak - (h + W + their "
             "gradients)",
             f"limit: 3 GEMMs of 2 x tokens x vocab x hidden FLOPs at the bf16 matmul rate "
             f"measured in this run, {peak:,.4g} TFLOP/s (the chunked path's recompute is a "
             "4th: 1.33x), and h + W + their gradients in memory; x_limit = seconds / limit_s"]
    if device != "cuda":
        notes.append("peak memory: not measured (no CUDA allocator on CPU); the memory target "
                     "is decided on a GPU only")
    notes += notes_on(rows, args.smoke)
    write_results("lm_head_smoke" if args.smoke else "lm_head", args.out, info, rows,
                  ["tokens", "path", "chunk_rows", "result", "seconds", "limit_s", "x_limit",
                   "peak_GiB", "over_GiB", "loss"], notes)


if __name__ == "__main__":
    main()

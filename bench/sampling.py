"""The native engine's per-step sampler alone (issue 16): ours against the torch paths and the
memory limit, at decode batches over Qwen3's vocabulary.

    python -m bench.sampling [--batches 64,256] [--vocab 151936]

Per batch and temperature, each path draws one token per row from softmax(logits / T) of the
LM head's bf16 logits and returns its temperature-1 log-prob:
- ours: `kernels.sample_temperature` (inverse CDF over 1,024-wide vocabulary tiles: a pass that
  reads the logits once for each tile's max and sums of exp, then one program per row that picks
  a tile and a logit in it with two Philox uniforms);
- torch race: `sampling.sample_torch` (log-sum-exp, softmax, an Exp(1) race: argmax p / E;
  the engine's path for top-k / top-p and on CPU);
- torch multinomial: softmax then `torch.multinomial`, plus the log-sum-exp;
- limit: the logits' bytes read once at the copy bandwidth measured in the same run.
`graph_us`: the GPU time, replayed from a CUDA graph (`triton.testing.do_bench_cudagraph`);
`eager_us`: launched from Python as the engine does (sampling runs outside its decode graph).
`lp_err`: largest |log-prob - log_softmax(logits)[token]|. `--smoke`: tiny shapes under the
Triton interpreter on the CPU, no timing.
"""
from __future__ import annotations

import os

import torch

from bench.common import device_info, measure_copy_bandwidth, parse_args, write_results


def paths(K, seed: torch.Tensor) -> dict:
    from rl.rollout.base import SamplingParams
    from rl.rollout.native.sampling import sample_torch

    def multinomial(x, t):
        lse = torch.logsumexp(x.float(), -1)
        tok = torch.multinomial((x.float() / t).softmax(-1), 1).squeeze(-1)
        return tok, x.float().gather(-1, tok[:, None]).squeeze(-1) - lse

    return {"ours (inverse CDF over tiles)": lambda x, t: K.sample_temperature(x, t, seed),
            "torch race (exponential)": lambda x, t: sample_torch(
                x, SamplingParams(temperature=t), None),
            "torch multinomial": multinomial}


def main() -> None:
    def extra(p):
        p.add_argument("--batches", default="64,256")
        p.add_argument("--vocab", type=int, default=151936)
    args = parse_args(__doc__.splitlines()[0], extra)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    from rl.rollout.native import kernels as K
    gpu = not args.smoke
    device = "cuda" if gpu else "cpu"
    batches = [4] if args.smoke else [int(b) for b in args.batches.split(",")]
    vocab = 3000 if args.smoke else args.vocab
    bw = measure_copy_bandwidth(device, 2.0) * 1e9 if gpu else None
    if gpu:
        from triton.testing import do_bench, do_bench_cudagraph
    seed = torch.tensor([1234], dtype=torch.int32, device=device)
    rows = []
    for b in batches:
        g = torch.Generator(device=device).manual_seed(0)
        logits = (torch.randn(b, vocab, device=device, generator=g) * 3).to(
            torch.bfloat16 if gpu else torch.float32)
        ref = torch.log_softmax(logits.float(), -1)
        limit_us = logits.numel() * logits.element_size() / bw * 1e6 if gpu else None
        for temp in (1.0, 0.7):
            for name, fn in paths(K, seed).items():
                tok, lp = fn(logits, temp)
                err = (lp - ref.gather(-1, tok[:, None]).squeeze(-1)).abs().max().item()
                graph = do_bench_cudagraph(lambda: fn(logits, temp), rep=100) * 1e3 if gpu \
                    else None
                eager = do_bench(lambda: fn(logits, temp), rep=100) * 1e3 if gpu else None
                rows.append({"batch": b, "vocab": vocab, "temperature": temp, "path": name,
                             "graph_us": graph, "eager_us": eager, "limit_us": limit_us,
                             "limit_over_graph": limit_us / graph if gpu else None,
                             "lp_err": err})
                print(rows[-1], flush=True)
    for r in rows:
        base = next(o for o in rows if o["batch"] == r["batch"] and o["temperature"] ==
                    r["temperature"] and o["path"].startswith("ours"))
        r["ours_faster_x"] = r["graph_us"] / base["graph_us"] if gpu else None
    notes = ["logits: N(0, 3^2) in bf16 (fp32 on CPU); every path returns (token, "
             "temperature-1 log-prob) per row",
             "graph_us: do_bench_cudagraph median; eager_us: do_bench median (host launches "
             "included)",
             f"limit_us: the logits' bytes once at the copy bandwidth measured in this run, "
             f"{bw / 1e9:,.0f} GB/s (read + write)" if gpu else "smoke: Triton interpreter on "
             "CPU, no timing",
             "ours_faster_x: this path's graph_us over ours (> 1: ours is faster)"]
    write_results("sampling" + ("_smoke" if args.smoke else ""), args.out, device_info(), rows,
                  list(rows[0]), notes)


if __name__ == "__main__":
    main()

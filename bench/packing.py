"""Sequence packing in the trainer's forward + backward (`trainer.pack_sequences`): padded
micro-batches against packed ones on one device, on two length mixes, against the limit.

Both paths build their micro-batches as the trainer does (`rl.trainer.microbatch.micro_batches`
with the same `--budget`: padded counts rows x the longest row, packed counts real tokens) and
their model inputs with `rl.trainer.packing.model_inputs`; a step is forward + backward of the
sum of every response token's log-prob over all micro-batches (`losses.token_logprobs`, the
padded layout back from `unpack`). A plain transformers model with the trainer's packed
attention (`rl.trainer.packing.install`: FlashAttention varlen on a GPU in bf16, SDPA row by
row on the CPU), no DeepSpeed.

Mixes (prompt + response lengths, seeded): `demo`, the CPU demo's (prompts of 6-12 tokens,
responses of 1-8); `long_tail`, RL on reasoning (prompts 64-256, responses log-normal with a
median of 1/8 of `--max-response` and capped there): most rows are short, a few long.

Limit: the padded path's time scaled by real / padded tokens (what padding-free compute at the
padded path's speed would take; packing can beat it, since its micro-batches are fewer and
fuller). Target (issue 40): packed >= 1.5x the padded path's tokens/s on the long-tail mix on a
GPU, in the same run; the log-probs of the two paths agree (reported).

Run: python -m bench.packing [--model qwen3_06b] [--budget 16384] [--rows 256] [--reps 3]
"""
from __future__ import annotations

import random
import statistics
import time

import torch

from bench.common import (QWEN3_06B, TINY, device_info, parse_args, random_model, sync,
                          write_results)

MODELS = {"qwen3_06b": QWEN3_06B, "tiny": TINY}
TARGET_SPEEDUP = 1.5


def length_mix(name: str, rows: int, max_response: int, seed: int = 0
               ) -> tuple[list[int], list[int]]:
    """(prompt lengths, response lengths) of `rows` samples of mix `name`."""
    rng = random.Random(seed)
    if name == "demo":
        return ([rng.randint(6, 12) for _ in range(rows)],
                [rng.randint(1, 8) for _ in range(rows)])
    median = max(1, max_response // 8)
    return ([rng.randint(64, 256) for _ in range(rows)],
            [min(max_response, max(1, int(rng.lognormvariate(0, 1.0) * median)))
             for _ in range(rows)])


def _batch(prompt_lens: list[int], response_lens: list[int], vocab: int, seed: int = 0):
    from rl.trainer.batch import TrainBatch
    g = torch.Generator().manual_seed(seed)
    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()
    responses = [ids(n) for n in response_lens]
    return TrainBatch(prompt_ids=[ids(n) for n in prompt_lens], response_ids=responses,
                      rollout_logprobs=[[-1.0] * len(r) for r in responses],
                      advantages=[1.0] * len(responses))


def _step(model, mbs, packed: bool, device: str) -> tuple[float, list[torch.Tensor]]:
    """Forward + backward over every micro-batch; (summed log-prob, each row's log-probs)."""
    from rl.trainer import losses
    from rl.trainer.packing import model_inputs, unpack
    total, rows = 0.0, []
    for mb in mbs:
        kwargs, targets, layout = model_inputs(mb.input_ids, mb.attention_mask, packed, device)
        logp = losses.token_logprobs(model(**kwargs).logits[:, :-1], targets)
        if layout is not None:
            logp = unpack(logp, layout)
        mask = mb.resp_mask[:, 1:].to(device)
        loss = (logp * mask).sum()
        loss.backward()
        total += loss.item()
        rows += [logp[i][mask[i].bool()].detach().float().cpu() for i in range(len(mb.index))]
    return total, rows


def measure(model, batch, budget: int, packed: bool, device: str, warmup: int, reps: int
            ) -> dict:
    from rl.trainer.microbatch import micro_batches
    mbs = micro_batches(batch, list(range(len(batch))), budget, 1, packed=packed)
    real = sum(int(mb.attention_mask.sum()) for mb in mbs)
    computed = real if packed else sum(mb.input_ids.numel() for mb in mbs)
    for _ in range(warmup):
        model.zero_grad(set_to_none=True)
        _step(model, mbs, packed, device)
    times = []
    for _ in range(reps):
        model.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        total, rows = _step(model, mbs, packed, device)
        sync()
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    order = [i for mb in mbs for i in mb.index]
    by_sample = dict(zip(order, rows))
    return {"path": "packed" if packed else "padded", "micro_batches": len(mbs),
            "real_tokens": real, "computed_tokens": computed, "seconds": seconds,
            "tokens_per_s": real / seconds, "logp_sum": total,
            "_rows": [by_sample[i] for i in range(len(batch))]}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], lambda p: (
        p.add_argument("--model", choices=sorted(MODELS), default="qwen3_06b"),
        p.add_argument("--budget", type=int, default=16384),
        p.add_argument("--rows", type=int, default=256),
        p.add_argument("--max-response", type=int, default=2048),
        p.add_argument("--mixes", nargs="+", default=["demo", "long_tail"]),
        p.add_argument("--warmup", type=int, default=1),
        p.add_argument("--reps", type=int, default=3)))
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.smoke:
        args.model, args.budget, args.rows, args.max_response, args.warmup, args.reps = (
            "tiny", 256, 24, 64, 0, 1)
    fields = MODELS[args.model]
    model = random_model("qwen3", fields, device, dtype).train()
    from rl.trainer.packing import install
    install(model)  # what the trainer does with pack_sequences: varlen attention
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    rows, notes = [], []
    tag = " (smoke run: not a measurement)" if args.smoke else ""
    for mix in args.mixes:
        prompt_lens, response_lens = length_mix(mix, args.rows, args.max_response)
        batch = _batch(prompt_lens, response_lens, fields["vocab_size"])
        padded = measure(model, batch, args.budget, False, device, args.warmup, args.reps)
        packed = measure(model, batch, args.budget, True, device, args.warmup, args.reps)
        worst = max((a - b).abs().max().item() for a, b in zip(padded.pop("_rows"),
                                                             packed.pop("_rows")))
        limit_s = padded["seconds"] * padded["real_tokens"] / padded["computed_tokens"]
        speedup = packed["tokens_per_s"] / padded["tokens_per_s"]
        for r in (padded, packed):
            r.update(mix=mix, result="ok", limit_s=limit_s, x_limit=r["seconds"] / limit_s)
        packed.update(speedup=speedup, logp_max_diff=worst)
        rows += [{"mix": mix, "path": "limit", "result": "ok", "seconds": limit_s,
                  "limit_s": limit_s, "x_limit": 1.0, "real_tokens": padded["real_tokens"],
                  "computed_tokens": padded["real_tokens"]}, padded, packed]
        for r in (padded, packed):
            print({k: v for k, v in r.items()}, flush=True)
        what = f"{mix} mix: packed {speedup:.2f}x the padded path's tokens/s"
        if mix == "long_tail" and device == "cuda":
            met = "MET" if speedup >= TARGET_SPEEDUP else "NOT MET"
            notes.append(f"target packed >= {TARGET_SPEEDUP}x padded on the long-tail mix "
                         f"(GPU): {met} ({what}){tag}")
        else:
            notes.append(f"{what} (padding {padded['computed_tokens'] / padded['real_tokens']:.2f}"
                         f"x the real tokens){tag}")
        notes.append(f"{mix} mix: log-probs of the two paths, max |difference| {worst:.2e}")
    if device != "cuda":
        notes.append("the target is decided on a GPU only")
    info = {**device_info(), "model": args.model, "dtype": str(dtype).replace("torch.", ""),
            "budget": args.budget, "rows": args.rows, "max_response": args.max_response,
            "warmup": args.warmup, "reps": args.reps}
    notes.insert(0, f"model: random Qwen3 ({args.model}) in {info['dtype']}, {args.rows} rows a "
                    f"mix, micro-batch budget {args.budget:,} tokens; step = forward + backward "
                    f"of the response log-probs over every micro-batch; median of {args.reps} "
                    f"after {args.warmup} warm-up")
    notes.insert(1, "limit: the padded path's time x real / padded tokens (padding-free compute "
                    "at its speed)")
    write_results("packing_smoke" if args.smoke else "packing", args.out, info, rows,
                  ["mix", "path", "micro_batches", "real_tokens", "computed_tokens", "seconds",
                   "tokens_per_s", "limit_s", "x_limit", "speedup", "logp_max_diff"], notes)


if __name__ == "__main__":
    main()

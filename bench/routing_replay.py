"""Routing replay (R3): how far the native FP8 engine's routing and log-probs are from the BF16
trainer model's, with and without replaying the engine's routing in the trainer, on a random
Qwen3-MoE-small-shaped model, one GPU.

The engine (native, FP8 block-quantised weights) samples `--batch` prompts of `--prompt-len`
random tokens, `--new` tokens each (temperature 1, no EOS), returning the routing of every token.
The trainer side is the HF model in BF16 with the same weights, which scores those samples
twice: with its own routing (`off`) and replaying the engine's (`r3`). Per setting:
- routing_agreement: fraction of the engine's (token, layer, expert) choices the trainer's own
  router also makes (the same number in both rows: it is measured before any replay);
- kl_k1 = mean(logp_engine - logp_trainer) and kl_k3 = mean(exp(d) - d - 1), d = logp_trainer -
  logp_engine, over sampled response tokens: estimates of KL(engine || trainer);
- mean |d|, max |d|, and the time of the trainer's scoring forward.
Costs: the engine's generate time with and without routing capture, and the bytes of routing
per token (layers x top_k x 1 byte for <= 256 experts).

Leaves out: a trained model (random routers are less peaked than trained ones, so more choices
sit near a tie; treat the agreement as a lower bound), and the backward pass.

Run: python -m bench.routing_replay
"""
from __future__ import annotations

import time

import numpy as np
import torch

from bench.common import (QWEN3_MOE_SMALL, TINY_MOE, device_info, parse_args, random_model, sync,
                          write_results)


def trainer_logprobs(model, samples, routers, replay: bool, rows: int):
    """Per-sample response log-probs of `model`; returns (list of fp32 arrays, agree, total)."""
    from rl.trainer.microbatch import pad_batch

    out, agree, total = [], 0, 0
    for c in range(0, len(samples), rows):
        chunk = samples[c:c + rows]
        mb = pad_batch([s.prompt_ids for s in chunk], [s.response_ids for s in chunk],
                       routing=[s.routing for s in chunk])
        dev = next(model.parameters()).device
        # Without replay the routers only record: the trainer's own routing, compared below.
        with torch.no_grad(), routers.capture(mb.routing if replay else None,
                                              mb.routing_mask if replay else None) as cap:
            logits = model(input_ids=mb.input_ids.to(dev),
                           attention_mask=mb.attention_mask.to(dev)).logits[:, :-1]
        if not replay:
            own = routers.recorded_BLNK(cap, tuple(mb.input_ids.shape))
            hits = (own[..., :, None] == mb.routing[..., None, :]).any(-1)[mb.routing_mask]
            agree, total = agree + int(hits.sum()), total + int(hits.numel())
        lp = torch.log_softmax(logits.float(), -1).gather(
            -1, mb.input_ids[:, 1:, None].to(dev)).squeeze(-1).cpu()
        for i, s in enumerate(chunk):
            p = len(s.prompt_ids)
            out.append(lp[i, p - 1:p - 1 + len(s.response_ids)].numpy())
    return out, agree, total


def main() -> None:
    from rl.config import RolloutConfig
    from rl.models.name_maps import full_state_for_engine
    from rl.models.routing import RoutingReplay
    from rl.rollout.base import SamplingParams
    from rl.rollout.native.engine import NativeEngine

    args = parse_args(__doc__.splitlines()[0], lambda p: (
        p.add_argument("--batch", type=int, default=64), p.add_argument("--new", type=int,
                                                                         default=128),
        p.add_argument("--prompt-len", type=int, default=128),
        p.add_argument("--score-rows", type=int, default=8)))
    gpu = not args.smoke
    device = "cuda" if gpu else "cpu"
    fields = QWEN3_MOE_SMALL if gpu else TINY_MOE
    batch, new, prompt_len = (args.batch, args.new, args.prompt_len) if gpu else (4, 6, 8)
    hf = random_model("qwen3_moe", fields, device, torch.bfloat16 if gpu else torch.float32)
    cfg = RolloutConfig(engine="native", quantization="fp8", max_batch_size=batch,
                        max_model_len=prompt_len + new, max_new_tokens=new)
    engine = NativeEngine.from_config(hf.config, cfg, device=device,
                                      dtype="bfloat16" if gpu else "float32")
    engine.load_weights(full_state_for_engine(hf), version=1)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, hf.config.vocab_size, (batch, prompt_len), generator=g).tolist()

    def generate(routing: bool):
        sp = SamplingParams(temperature=1.0, max_new_tokens=new, seed=2, return_routing=routing)
        engine.generate(prompts, SamplingParams(max_new_tokens=3, seed=1, return_routing=routing))
        sync()
        t0 = time.perf_counter()
        out = [s for grp in engine.generate(prompts, sp) for s in grp]
        sync()
        return out, time.perf_counter() - t0

    _, gen_plain = generate(False)
    samples, gen_routed = generate(True)
    routers = RoutingReplay(hf)
    engine_lp = [np.asarray(s.logprobs, dtype=np.float32) for s in samples]
    bytes_per_token = routers.num_layers * routers.top_k * routers.dtype.itemsize
    rows = []
    for setting in ("off", "r3"):
        trainer_logprobs(hf, samples[:args.score_rows], routers, setting == "r3",
                         args.score_rows)  # warm-up
        sync()
        t0 = time.perf_counter()
        lps, agree, total = trainer_logprobs(hf, samples, routers, setting == "r3",
                                             args.score_rows)
        sync()
        seconds = time.perf_counter() - t0
        d = np.concatenate([t - e for t, e in zip(lps, engine_lp)]).astype(np.float64)
        rows.append({"setting": setting, "tokens": int(d.size),
                     "kl_k1": float(np.mean(-d)), "kl_k3": float(np.mean(np.expm1(d) - d)),
                     "mean_abs_logp_diff": float(np.mean(np.abs(d))),
                     "max_abs_logp_diff": float(np.max(np.abs(d))),
                     "trainer_score_s": seconds})
        if setting == "off":
            agreement = agree / max(total, 1)
    for r in rows:
        r["routing_agreement"] = agreement
    info = {**device_info(), "model": "Qwen3-MoE-small" if gpu else "tiny Qwen3-MoE",
            "engine_generate_s": gen_plain, "engine_generate_with_routing_s": gen_routed,
            "routing_bytes_per_token": bytes_per_token}
    notes = [f"engine: native, FP8 weights, batch {batch} x ({prompt_len} prompt + {new} new) "
             f"tokens, temperature 1; trainer: HF {'BF16' if gpu else 'fp32'} with the same "
             f"weights, scoring in chunks of {args.score_rows} rows",
             f"engine generate {gen_plain:.3f} s without routing capture, {gen_routed:.3f} s with "
             f"it; routing costs {bytes_per_token} bytes per token ({routers.num_layers} layers "
             f"x top-{routers.top_k}, {routers.dtype})",
             "routing_agreement is measured once (the trainer's own routing vs the engine's)",
             "kl_k1 = mean(logp_engine - logp_trainer), kl_k3 = mean(exp(d) - d - 1) with "
             "d = logp_trainer - logp_engine, over sampled tokens"]
    write_results("routing_replay" + ("_smoke" if args.smoke else ""), args.out, info, rows,
                  ["setting", "routing_agreement", "kl_k1", "kl_k3", "mean_abs_logp_diff",
                   "max_abs_logp_diff", "tokens", "trainer_score_s"], notes)
    engine.shutdown()


if __name__ == "__main__":
    main()

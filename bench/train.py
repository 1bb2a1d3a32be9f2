"""Actor training step on one GPU: the RL loop's DeepSpeed `TrainerWorker.train_step` in BF16 on
a random Qwen3-0.6B-shaped model; tokens/s and MFU against the bf16 matmul peak measured in the
same run.

One step = the loop's real work: a no-grad forward for the old log-probs, then forward + backward
+ AdamW step over the batch (`--seqs` sequences of `--prompt` + `--response` tokens, packed into
micro-batches of `--micro-batch-tokens`). FLOPs: 2N per token for the old-log-prob forward and 6N
for forward + backward (N = matmul parameters incl. the LM head), plus causal attention
(4 x S/2 x heads x head_dim per token per layer forward, x2 backward). "MFU" counts the 6N + attention
training FLOPs only; "HFU" adds the old-log-prob forward the step also runs.

Run: python -m bench.train   (needs `deepspeed` importable)
"""
from __future__ import annotations

import random
import statistics
import tempfile
import time

import torch

from bench.common import (QWEN3_06B, TINY, device_info, hf_config, measure_bf16_peak,
                          parse_args, random_model, sync, write_results)


def main() -> None:
    from rl.cluster.groups import free_port
    from rl.config import AlgorithmConfig, SyncConfig, TrainerConfig
    from rl.rollout.native.model import Shape
    from rl.trainer.batch import TrainBatch
    from rl.trainer.worker import RankInfo, TrainerWorker

    args = parse_args(__doc__.splitlines()[0], lambda p: (
        p.add_argument("--seqs", type=int, default=32),
        p.add_argument("--prompt", type=int, default=128),
        p.add_argument("--response", type=int, default=896),
        p.add_argument("--micro-batch-tokens", type=int, default=16384),
        p.add_argument("--zero-stage", type=int, default=2),
        p.add_argument("--steps", type=int, default=3)))
    gpu = not args.smoke
    device = "cuda" if gpu else "cpu"
    fields = QWEN3_06B if gpu else TINY
    seqs, prompt, response = (args.seqs, args.prompt, args.response) if gpu else (4, 8, 8)
    steps = args.steps if gpu else 1
    peak = measure_bf16_peak(device, 8192 if gpu else 256)
    model_dir = tempfile.mkdtemp(prefix="bench_train_")
    model = random_model("qwen3", fields, device, torch.bfloat16 if gpu else torch.float32)
    model.save_pretrained(model_dir)
    del model
    torch.cuda.empty_cache() if gpu else None
    cfg = TrainerConfig(num_ranks=1, zero_stage=args.zero_stage, device=device, lr=1e-6,
                        micro_batch_tokens=args.micro_batch_tokens if gpu else 64,
                        torch_threads=4 if gpu else 1)
    worker = TrainerWorker(cfg, AlgorithmConfig(kl_coef=0.0), SyncConfig(), model_dir,
                           "bfloat16" if gpu else "float32",
                           RankInfo(rank=0, world_size=1, master_addr="127.0.0.1",
                                    master_port=free_port()), 0, steps + 1)
    rng = random.Random(0)
    vocab = fields["vocab_size"]
    batch = TrainBatch(
        prompt_ids=[[rng.randrange(2, vocab) for _ in range(prompt)] for _ in range(seqs)],
        response_ids=[[rng.randrange(2, vocab) for _ in range(response)] for _ in range(seqs)],
        rollout_logprobs=[[-11.0] * response for _ in range(seqs)],
        advantages=[1.0 if i % 2 else -1.0 for i in range(seqs)])
    times = []
    for step in range(steps + 1):
        sync()
        t0 = time.perf_counter()
        stats = worker.train_step(batch, step).metrics
        sync()
        if step:  # the first step compiles / allocates
            times.append(time.perf_counter() - t0)
    worker.shutdown()
    seconds = statistics.median(times)
    shape = Shape.from_hf_config(hf_config("qwen3", fields))
    n_matmul = shape.num_params() - (0 if shape.tied else shape.vocab * shape.hidden)
    tokens = seqs * (prompt + response)
    seq = prompt + response
    attn_fwd = 4 * (seq / 2) * shape.nh * shape.head_dim * shape.layers * tokens
    train_flops = 6 * n_matmul * tokens + 3 * attn_fwd
    all_flops = train_flops + 2 * n_matmul * tokens + attn_fwd
    row = {"model": "Qwen3-0.6B" if gpu else "tiny", "zero_stage": args.zero_stage,
           "tokens_per_step": tokens, "seconds_per_step": seconds,
           "tokens_per_s": tokens / seconds, "train_TFLOPs": train_flops / seconds / 1e12,
           "MFU": train_flops / seconds / (peak * 1e12),
           "HFU_incl_old_logprob_fwd": all_flops / seconds / (peak * 1e12),
           "loss": stats.get("train/loss"), "grad_norm": stats.get("train/grad_norm")}
    notes = [f"batch: {seqs} sequences x ({prompt} prompt + {response} response) tokens, "
             f"micro-batches of {cfg.micro_batch_tokens} tokens, DeepSpeed ZeRO-{args.zero_stage}, "
             f"bf16, torch AdamW; median of {steps} steps after 1 warm-up",
             f"bf16 matmul peak measured in this run: {peak:,.0f} TFLOP/s (8192^3)",
             f"N = {n_matmul / 1e9:.3f} B matmul parameters (incl. the tied LM head)"]
    write_results("train" + ("_smoke" if args.smoke else ""), args.out,
                  {**device_info(), "bf16_peak_TFLOPs": peak}, [row], list(row), notes)


if __name__ == "__main__":
    main()

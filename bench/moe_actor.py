"""MoE actor training step on 2 GPUs: a DeepSeek-V4-shaped model (the published Flash dims, cut to
a few layers and fewer experts) under ZeRO-3 with expert parallelism (EP=2,
`trainer.expert_parallel_size`) against ZeRO-3 alone (EP=1); tokens/s per GPU, MFU on active
parameters, bytes all-gathered / reduce-scattered / all-to-all'd per step and rank, peak memory.

One step is `TrainerWorker.train_step` (old-log-prob forward, then forward + backward + AdamW),
two ranks as plain processes (NCCL on GPUs, gloo on CPU). MFU counts 6 x active matmul parameters
(routed experts at top_k / E, no input embedding) per token, attention FLOPs left out, against
the bf16 matmul peak measured in this run. Communication is counted in each rank's process by
wrapping `torch.distributed`'s collectives before DeepSpeed binds them: per call, the bytes of
the larger buffer (the gathered output, the scattered input, the all-to-all input). Leaves out:
hash-routed layers (all MoE layers are learned-routed here) and the weight sync.

Run: python -m bench.moe_actor   (2 GPUs; `deepspeed` importable)
     python -m bench.moe_actor --ranks 1 --zero-stage 2 --ep 1   (one GPU: the DeepSpeed step's
     own cost on the fused V4 layers, no collectives; writes moe_actor_1gpu_zero2.{json,md})
"""
from __future__ import annotations

import math
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import device_info, measure_bf16_peak, parse_args, write_results
from rl.trainer.worker import TrainerWorker

_COUNTED = ("all_gather_into_tensor", "_all_gather_base", "all_gather", "reduce_scatter_tensor",
            "_reduce_scatter_base", "all_to_all_single", "all_reduce", "broadcast")
_KIND = {"all_gather_into_tensor": "all_gather", "_all_gather_base": "all_gather",
         "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter"}


def _nbytes(x) -> int:
    if torch.is_tensor(x):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _count_collectives(counts: dict[str, int]) -> None:
    import torch.distributed as dist

    for name in _COUNTED:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def wrapped(*args, _fn=fn, _kind=_KIND.get(name, name), **kw):
            size = max([_nbytes(a) for a in (*args, *kw.values())] or [0])
            counts[_kind] = counts.get(_kind, 0) + size
            return _fn(*args, **kw)
        setattr(dist, name, wrapped)


class CountingWorker(TrainerWorker):
    """A trainer rank that counts its collectives' bytes (bench only)."""

    def __init__(self, *args, **kwargs):
        self.comm: dict[str, int] = {}
        _count_collectives(self.comm)  # before DeepSpeed caches torch.distributed's functions
        super().__init__(*args, **kwargs)

    def measured_step(self, batch, step: int) -> dict:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.comm.clear()
        t0 = time.perf_counter()
        stats = self.train_step(batch, step).metrics
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return {"seconds": time.perf_counter() - t0, "comm": dict(self.comm),
                "peak_gib": (torch.cuda.max_memory_allocated() / 2**30
                             if self.device.type == "cuda" else None),
                "loss": stats["train/loss"], "grad_norm": stats["train/grad_norm"]}

    def profiled_step(self, batch, step: int, path: str) -> None:
        """One step under torch.profiler; rank 0 writes the operators and kernels that took the
        most device time (self time, so nested operators are not counted twice) to `path`."""
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                          if self.device.type == "cuda" else [])
        t0 = time.perf_counter()
        with profile(activities=acts) as prof:
            self.train_step(batch, step)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        if self.rank == 0:
            key = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            events = prof.key_averages()
            phases = [e for e in events if e.key.startswith("rl.")]
            lines = [f"wall {wall:.3f} s (under the profiler)", "phases (host time / device time):"]
            lines += [f"  {e.key:<20} x{e.count:<3} host {e.cpu_time_total / 1e6:8.3f} s   "
                      f"device {e.device_time_total / 1e6:8.3f} s" for e in phases]
            Path(path).write_text("\n".join(lines) + "\n\n" + events.table(
                sort_by=key, row_limit=45, max_name_column_width=70))


def v4_model_dir(gpu: bool, layers: int, experts: int) -> tuple[str, dict]:
    """A saved random V4 model directory and its parameter counts."""
    from rl.config import ModelConfig
    from rl.models.loading import resolve_model_dir
    from rl.models.presets import save_model
    if not gpu:
        path = resolve_model_dir(ModelConfig(preset="tiny-deepseek-v4"),
                                 Path(tempfile.mkdtemp(prefix="moe_actor_")))
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(str(path))
    else:
        from bench.v4_attention import FLASH
        from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
        kinds = ["sliding_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention"]
        dims = {**FLASH, "vocab_size": 129280, "moe_intermediate_size": 2048,
                "n_routed_experts": experts, "num_experts_per_tok": 6, "n_shared_experts": 1,
                "hc_mult": 4, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
                "swiglu_limit": 10.0,
                "compress_rates": {"compressed_sparse_attention": 4,
                                   "heavily_compressed_attention": 128}}
        config = DeepseekV4Config(num_hidden_layers=layers,
                                  layer_types=[kinds[i % 3] for i in range(layers)],
                                  mlp_layer_types=["moe"] * layers, attn_implementation="eager",
                                  **dims)
        from transformers import DeepseekV4ForCausalLM
        torch.manual_seed(0)
        with torch.device("cuda"):  # bf16, the norms / mixers V4 pins to fp32 kept fp32
            model = DeepseekV4ForCausalLM._from_config(config, dtype=torch.bfloat16)
        path = tempfile.mkdtemp(prefix="moe_actor_")
        save_model(model, path)
        del model
        torch.cuda.empty_cache()
    h, inter, e = config.hidden_size, config.moe_intermediate_size, config.n_routed_experts
    num_moe = config.num_hidden_layers
    routed = num_moe * e * 3 * h * inter
    return str(path), {"routed": routed, "experts": e, "top_k": config.num_experts_per_tok,
                       "embed": config.vocab_size * h}


def run(model_dir: str, ep: int, gpu: bool, args, batch) -> dict:
    from rl.cluster.actors import ProcActor, wait_all
    from rl.cluster.groups import free_port
    from rl.config import AlgorithmConfig, SyncConfig, TrainerConfig
    from rl.trainer.worker import RankInfo

    n = args.ranks
    cfg = TrainerConfig(num_ranks=n, zero_stage=args.zero_stage, device="cuda" if gpu else "cpu",
                        lr=1e-6,
                        micro_batch_tokens=args.micro_batch_tokens if gpu else 64,
                        activation_checkpointing=True, expert_parallel_size=ep,
                        torch_threads=4 if gpu else 1)
    port = free_port()
    ranks = [ProcActor(CountingWorker, cfg, AlgorithmConfig(kl_coef=0.0), SyncConfig(),
                       model_dir, "bfloat16" if gpu else "float32",
                       RankInfo(rank=r, world_size=n, master_addr="127.0.0.1", master_port=port),
                       0, 10, name=f"ep{ep}-rank{r}", env={"LOCAL_RANK": str(r)})
             for r in range(n)]
    try:
        wait_all([a.ready for a in ranks], timeout=1200)
        steps = [wait_all([a.call("measured_step", batch, s) for a in ranks], timeout=1200)
                 for s in range((args.steps if gpu else 1) + 1)]
        if args.profile:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            path = str(Path(args.out) / f"moe_actor_profile_ep{ep}.txt")
            wait_all([a.call("profiled_step", batch, len(steps), path) for a in ranks],
                     timeout=1200)
    finally:
        for a in ranks:
            a.close()
    timed = steps[1:]  # the first step allocates and compiles
    return {"seconds": statistics.median(max(r["seconds"] for r in s) for s in timed),
            "comm": {k: max(r["comm"].get(k, 0) for r in timed[-1])
                     for k in set().union(*(r["comm"] for r in timed[-1]))},
            "peak_gib": max((r["peak_gib"] or 0.0) for s in timed for r in s) or None,
            "loss": timed[-1][0]["loss"], "grad_norm": timed[-1][0]["grad_norm"]}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], lambda p: (
        p.add_argument("--layers", type=int, default=2),
        p.add_argument("--experts", type=int, default=64),
        p.add_argument("--seqs", type=int, default=8),
        p.add_argument("--prompt", type=int, default=512),
        p.add_argument("--response", type=int, default=1536),
        p.add_argument("--micro-batch-tokens", type=int, default=4096),
        p.add_argument("--steps", type=int, default=3),
        p.add_argument("--ep", default="1,2", help="expert-parallel sizes to run, comma list"),
        p.add_argument("--ranks", type=int, default=2, choices=(1, 2),
                       help="trainer ranks, one GPU each"),
        p.add_argument("--zero-stage", type=int, default=3, choices=(2, 3)),
        p.add_argument("--profile", action="store_true",
                       help="after the timed steps, one step under torch.profiler per setup: "
                            "<out>/moe_actor_profile_ep<N>.txt")))
    gpu = not args.smoke
    eps = [int(e) for e in args.ep.split(",")]
    if any(e > args.ranks or args.ranks % e for e in eps):
        raise SystemExit(f"bench.moe_actor: --ep {args.ep} with --ranks {args.ranks}: each "
                         "expert-parallel size must divide the ranks")
    if gpu and torch.cuda.device_count() < args.ranks:
        raise SystemExit(f"bench.moe_actor needs {args.ranks} GPU(s) (or --smoke on CPU)")
    ranks = args.ranks
    peak = measure_bf16_peak("cuda" if gpu else "cpu", 8192 if gpu else 256)
    model_dir, counts = v4_model_dir(gpu, args.layers, args.experts)
    seqs, prompt, response = (args.seqs, args.prompt, args.response) if gpu else (4, 8, 8)
    rng = random.Random(0)
    batch_vocab = 100  # in every vocab (the tiny preset's is 128)
    from rl.trainer.batch import TrainBatch
    batch = TrainBatch(
        prompt_ids=[[rng.randrange(3, batch_vocab) for _ in range(prompt)] for _ in range(seqs)],
        response_ids=[[rng.randrange(3, batch_vocab) for _ in range(response)]
                      for _ in range(seqs)],
        rollout_logprobs=[[-11.0] * response for _ in range(seqs)],
        advantages=[1.0 if i % 2 else -1.0 for i in range(seqs)])
    total = _num_params(model_dir)
    active = total - counts["routed"] * (1 - counts["top_k"] / counts["experts"]) - counts["embed"]
    tokens = seqs * (prompt + response)
    rows = []
    for ep in eps:
        r = run(model_dir, ep, gpu, args, batch)
        flops = 6 * active * tokens
        rows.append({
            "setup": f"ZeRO-{args.zero_stage}, " + ("EP=2" if ep == 2 else "no EP"),
            "seconds_per_step": r["seconds"], "tokens_per_s_per_gpu": tokens / r["seconds"] / ranks,
            "MFU_active": flops / r["seconds"] / (ranks * peak * 1e12),
            "all_gather_GB": r["comm"].get("all_gather", 0) / 1e9,
            "reduce_scatter_GB": r["comm"].get("reduce_scatter", 0) / 1e9,
            "all_to_all_GB": r["comm"].get("all_to_all_single", 0) / 1e9,
            "all_reduce_GB": r["comm"].get("all_reduce", 0) / 1e9,
            "peak_GiB": r["peak_gib"], "loss": r["loss"], "grad_norm": r["grad_norm"]})
    layers = args.layers if gpu else 4
    notes = [f"model: DeepSeek-V4 {'Flash dims' if gpu else 'tiny preset'}, {layers} layers, "
             f"{counts['experts']} experts top-{counts['top_k']}, {total / 1e9:.2f} B "
             f"parameters, {active / 1e9:.3f} B active (matmul, routed at top_k / E)",
             f"batch: {seqs} x ({prompt} + {response}) tokens = {tokens} per step over {ranks} "
             f"rank{'s' if ranks > 1 else ''}, "
             f"micro-batches of {args.micro_batch_tokens if gpu else 64} tokens, activation "
             f"checkpointing, {'bf16' if gpu else 'fp32'}, torch AdamW; median of the steps "
             "after 1 warm-up",
             f"bf16 matmul peak measured in this run: {peak:,.0f} TFLOP/s",
             "communication: bytes per step on the busier rank, counted per call on the larger "
             "buffer (gathered output, scattered input, all-to-all input)"]
    name = "moe_actor" if (ranks, args.zero_stage) == (2, 3) else (
        f"moe_actor_{ranks}gpu_zero{args.zero_stage}")
    write_results(name + ("_smoke" if args.smoke else ""), args.out,
                  {**device_info(), "bf16_peak_TFLOPs": peak}, rows, list(rows[0]), notes)


def _num_params(model_dir: str) -> int:
    """Parameters in the saved shards (routing buffers left out), read from their headers."""
    from safetensors import safe_open
    total = 0
    for shard in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            total += sum(math.prod(f.get_slice(n).get_shape()) for n in f.keys()
                         if not n.endswith(("tid2eid", "e_score_correction_bias")))
    return total


if __name__ == "__main__":
    main()

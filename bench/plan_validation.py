"""Check the memory planner against measured GPU memory: `python -m bench.plan_validation`.

For a small dense model (Qwen3-0.6B shape) and a small MoE (Qwen3-MoE, 8 layers, 64 experts
top-8) - `bench.common`'s shared shapes - with random weights built from a config (nothing
downloaded):

- trainer step, bf16 + AdamW with fp32 master weights, one GPU (= ZeRO-0, N=1): the allocator's
  growth for the bf16 parameters, fp32 master copy, bf16 gradients, Adam moments and the fp32
  gradient copy, and the forward+backward peak above the resident state (with and without
  activation checkpointing), against `rl.plan.memory.plan_trainer`;
- rollout engine, our FP8 path (`rl.quant.modules.swap_linears`, block 128x128): weights in
  BF16 and after the FP8 swap, and the KV cache a prefill of B x L tokens leaves, against
  `rollout_weight_bytes` and `kv_layout`.

Writes `plan_validation.json` and `plan_validation.md` (a table: planned, measured, error)
under `--out` (default bench/results) through `bench.common.write_results`. Weights, optimizer
state and KV cache must agree within 15% (exit 1 otherwise); activations are reported, not
judged (the planner's activation figure is an estimate by construction).

`--smoke` runs tiny shapes on the CPU to exercise every code path; without a CUDA allocator the
"measured" column there is the bytes the tensors hold, and no threshold is applied.

Deliberately left out: DeepSpeed (not installed on the GPU machine; ZeRO-0 on one GPU is
emulated with an fp32 master copy, which is what DeepSpeed's bf16 optimizer holds), vLLM (our
FP8 modules stand in for its FP8 weights), multi-GPU partitioning (pure division in the planner).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # `python bench/plan_validation.py` as well as `-m`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import (
    QWEN3_06B, QWEN3_MOE_SMALL, RESULTS, TINY, TINY_MOE, device_info, hf_config, random_model,
    write_results,
)
from rl.config import load_config
from rl.plan import check
from rl.plan.kv import kv_layout
from rl.plan.memory import line_gpu, rollout_weight_bytes, size

TOLERANCE = 0.15
JUDGED = {"bf16 parameters", "fp32 master weights", "bf16 gradients", "AdamW moments",
          "fp32 gradient copy", "rollout weights BF16", "rollout weights FP8", "KV cache"}
# name -> (model_type, GPU shape, --smoke shape): bench.common's shared benchmark models
SHAPES = {"dense-qwen3-0.6b": ("qwen3", QWEN3_06B, TINY),
          "moe-qwen3-64x8": ("qwen3_moe", QWEN3_MOE_SMALL, TINY_MOE)}
RUN = {"gpu": dict(batch=4, seq=2048, kv_batch=16, kv_len=4096),
       "smoke": dict(batch=2, seq=32, kv_batch=2, kv_len=48)}
COLUMNS = ["model", "quantity", "planned", "measured", "measured by", "error", "within 15%"]


class Meter:
    """Allocator bytes on CUDA; None on CPU (rows then use the tensors' own bytes)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> int | None:
        if not self.cuda:
            return None
        gc.collect()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    def reset_peak(self) -> None:
        if self.cuda:
            gc.collect()
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated() if self.cuda else None


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is not None and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def planned(config: dict, run: dict, checkpointing: bool):
    """The planner's verdict for a one-GPU ZeRO-0 trainer and a TP-1 FP8 rollout of `config`
    (an HF config dict), read back from a config.json like any model."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(config, default=str))
        seq = run["seq"]
        cfg = load_config(None, [
            "cluster.kind=slurm", "model.dtype=bfloat16", "trainer.num_ranks=1",
            "trainer.zero_stage=0", "cluster.trainer.nodes=1", "cluster.trainer.gpus_per_node=1",
            "cluster.rollout.gpus_per_node=1", f"trainer.micro_batch_tokens={run['batch'] * seq}",
            f"rollout.max_model_len={seq}", f"rollout.max_new_tokens={seq}",
            "rollout.quantization=fp8", f"plan.model_config={path}", "plan.overhead_gb=0",
            f"trainer.activation_checkpointing={str(checkpointing).lower()}",
            # the step below runs the full-logits path (measured before the chunked head)
            "trainer.chunked_lm_head=false"])
        return check(cfg, "validation")


def row(rows, model, what, plan_bytes, alloc, tensors):
    """One comparison. `alloc`: allocator growth (None off CUDA); `tensors`: bytes the tensors
    hold (None where only the allocator can tell, e.g. activation peaks)."""
    measured = alloc if alloc is not None else tensors
    err = None if measured is None or not plan_bytes else (measured - plan_bytes) / plan_bytes
    ok = abs(err) <= TOLERANCE if what in JUDGED and err is not None else None
    by = "allocator" if alloc is not None else "tensor bytes" if tensors is not None else "n/a (CPU)"
    rows.append({"model": model, "quantity": what, "planned_bytes": plan_bytes,
                 "measured_bytes": measured, "tensor_bytes": tensors, "error_frac": err, "ok": ok,
                 # display columns of the markdown table
                 "planned": size(plan_bytes), "measured by": by,
                 "measured": "n/a" if measured is None else size(measured),
                 "error": "n/a" if err is None else f"{100 * err:+.1f}%",
                 "within 15%": "-" if ok is None else ("yes" if ok else "NO")})


def trainer_rows(name, model_type, fields, run, device, meter, rows):
    from rl.trainer.losses import token_logprobs
    config = hf_config(model_type, fields).to_dict()
    v, vc = planned(config, run, False), planned(config, run, True)
    t = v.trainer
    m0 = meter.now()
    model = random_model(model_type, fields, device, torch.bfloat16)
    model.train()
    model.config.use_cache = False
    params = [p for p in model.parameters() if p.requires_grad]
    m1 = meter.now()
    row(rows, name, "bf16 parameters", line_gpu(t, "parameters"), m1 and m1 - m0, tensor_bytes(params))
    masters = [p.detach().float() for p in params]
    m2 = meter.now()
    row(rows, name, "fp32 master weights", line_gpu(t, "fp32 master"), m2 and m2 - m1,
        tensor_bytes(masters))
    opt = torch.optim.AdamW(masters, lr=1e-5, foreach=False)
    ids = torch.randint(0, fields["vocab_size"], (run["batch"], run["seq"]), device=device)

    def forward_backward():
        logits = model(input_ids=ids).logits[:, :-1]
        loss = -token_logprobs(logits, ids[:, 1:]).mean()
        del logits
        loss.backward()

    def optimizer_step():
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
        opt.step()
        for p, m in zip(params, masters):
            p.data.copy_(m)
            m.grad = None

    forward_backward()                      # step 1 creates gradients and Adam state
    m3 = meter.now()
    row(rows, name, "bf16 gradients", line_gpu(t, "gradients"), m3 and m3 - m2,
        tensor_bytes(p.grad for p in params))
    optimizer_step()
    m4 = meter.now()
    moments = [s for st in opt.state.values() for k, s in st.items() if k != "step"]
    row(rows, name, "AdamW moments", line_gpu(t, "AdamW moments"), m4 and m4 - m3,
        tensor_bytes(moments))
    fp32_grads = [p.grad.float() for p in params]
    m5 = meter.now()
    row(rows, name, "fp32 gradient copy", line_gpu(t, "fp32 gradient copy"), m5 and m5 - m4,
        tensor_bytes(fp32_grads))
    del fp32_grads
    for label, plan, ckpt in (("activations (fwd+bwd peak)", t, False),
                              ("activations, checkpointed", vc.trainer, True)):
        if ckpt:
            model.gradient_checkpointing_enable()
        model.zero_grad(set_to_none=False)  # steady state: gradient buffers stay allocated
        static = meter.now()
        meter.reset_peak()
        forward_backward()
        peak = meter.peak()
        act = line_gpu(plan, "activations: decoder") + line_gpu(plan, "activations: logits")
        row(rows, name, label, act, None if peak is None else peak - static, None)
    del model, opt, masters, params


def rollout_rows(name, model_type, fields, run, device, meter, rows):
    from rl.quant.modules import swap_linears
    arch = planned(hf_config(model_type, fields).to_dict(), run, False).arch
    m0 = meter.now()
    model = random_model(model_type, fields, device, torch.bfloat16)
    m1 = meter.now()
    row(rows, name, "rollout weights BF16", rollout_weight_bytes(arch, 1, False)[0],
        m1 and m1 - m0, tensor_bytes(p for p in model.parameters()))
    swap_linears(model)  # the replaced bf16 weights are freed with their modules
    m2 = meter.now()
    row(rows, name, "rollout weights FP8", rollout_weight_bytes(arch, 1, True)[0], m2 and m2 - m0,
        tensor_bytes([*model.parameters(), *(b for n, b in model.named_buffers()
                                              if "inv_freq" not in n)]))
    ids = torch.randint(0, fields["vocab_size"], (run["kv_batch"], run["kv_len"]), device=device)
    before = meter.now()
    with torch.no_grad():  # logits_to_keep=1: the KV cache, not a (B, L, vocab) logits tensor
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    del out
    after = meter.now()
    kv = kv_layout(arch, 1, 2).sequence_bytes(run["kv_len"]) * run["kv_batch"]
    held = tensor_bytes(t for layer in cache.layers for t in (layer.keys, layer.values))
    row(rows, name, "KV cache", kv, after and after - before, held)
    del model, cache


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: code paths only")
    p.add_argument("--out", default=str(RESULTS), help="directory for the json + md")
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: run on the GPU machine, or pass --smoke", file=sys.stderr)
        return 2
    if args.smoke:
        torch.set_num_threads(1)
    device = torch.device("cpu" if args.smoke else "cuda")
    meter, run, rows = Meter(device), RUN["smoke" if args.smoke else "gpu"], []
    for name, (model_type, gpu_fields, smoke_fields) in SHAPES.items():
        fields = smoke_fields if args.smoke else gpu_fields
        trainer_rows(name, model_type, fields, run, device, meter, rows)
        rollout_rows(name, model_type, fields, run, device, meter, rows)
    import transformers
    info = {**device_info(), "smoke": args.smoke, "transformers": transformers.__version__,
            "total_memory_gib": (torch.cuda.get_device_properties(0).total_memory / 2**30
                                 if meter.cuda else None), "run": run}
    notes = [f"trainer: one GPU, bf16 + AdamW with an fp32 master copy (= ZeRO-0), micro-batch "
             f"{run['batch']} x {run['seq']} tokens; rollout: block-FP8 weights "
             f"(rl.quant.swap_linears), KV cache of a {run['kv_batch']} x {run['kv_len']} prefill",
             f"weights, optimizer state and KV cache are judged (within {TOLERANCE:.0%}); "
             "activations are an estimate and only reported"]
    if args.smoke:
        notes.append("SMOKE: tiny shapes on the CPU; 'measured' = bytes the tensors hold")
    write_results("plan_validation", args.out, info, rows, COLUMNS, notes)
    bad = [r for r in rows if r["ok"] is False]
    if bad and not args.smoke:
        print(f"{len(bad)} quantities outside {TOLERANCE:.0%}: "
              + ", ".join(f"{r['model']}/{r['quantity']}" for r in bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

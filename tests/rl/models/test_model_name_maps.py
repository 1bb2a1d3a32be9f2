import pytest
import torch
from safetensors.torch import load_file

from rl.models.name_maps import checkpoint_state, full_state_for_engine, to_engine_weights
from rl.models.presets import PRESETS, build_model


@pytest.fixture(scope="module")
def models():
    return {name: build_model(name) for name in PRESETS}


@pytest.mark.parametrize("name", PRESETS)
def test_full_state_has_params_and_persistent_buffers(name, models):
    model = models[name]
    state = dict(full_state_for_engine(model))
    for pname, param in model.named_parameters():
        assert state[pname].data_ptr() == param.data_ptr()  # a view, not a copy
    assert not any("inv_freq" in n for n in state)
    buffers = {n for n in state if n.endswith(("tid2eid", "e_score_correction_bias"))}
    expected = {"tiny-qwen3-moe": 0, "tiny-deepseek-v3": 2, "tiny-deepseek-v4": 4}[name]
    assert len(buffers) == expected


@pytest.mark.parametrize("name", PRESETS)
def test_checkpoint_state_is_what_the_file_holds(name, models, preset_dirs):
    on_disk = load_file(str(preset_dirs[name] / "model.safetensors"))
    mapped = dict(checkpoint_state(models[name]))
    assert mapped.keys() == on_disk.keys()
    for key, tensor in on_disk.items():
        assert torch.equal(mapped[key], tensor), key


@pytest.mark.parametrize("name", PRESETS)
def test_buckets_map_like_the_whole_model(name, models):
    model = models[name]
    items = full_state_for_engine(model)
    whole = dict(to_engine_weights(model, items))
    parts = {}
    for bucket in (items[0::3], items[1::3], items[2::3]):
        parts.update(to_engine_weights(model, bucket))
    assert parts.keys() == whole.keys()
    assert all(torch.equal(parts[k], whole[k]) for k in whole)


def test_qwen3_experts_are_split_per_expert(models):
    mapped = dict(checkpoint_state(models["tiny-qwen3-moe"]))
    fused = models["tiny-qwen3-moe"].model.layers[0].mlp.experts.gate_up_proj  # (E, 2I, H)
    assert fused.shape == (8, 256, 128)
    assert torch.equal(mapped["model.layers.0.mlp.experts.3.gate_proj.weight"], fused[3, :128])
    assert torch.equal(mapped["model.layers.0.mlp.experts.3.up_proj.weight"], fused[3, 128:])


def test_deepseek_v4_uses_original_checkpoint_names(models):
    names = {n for n, _ in checkpoint_state(models["tiny-deepseek-v4"])}
    assert {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base",
            "hc_head_scale", "layers.0.attn.kv_norm.weight", "layers.0.attn.q_norm.weight",
            "layers.0.ffn.gate.tid2eid", "layers.1.ffn.gate.bias",
            "layers.1.attn.compressor.norm.weight", "layers.1.attn.indexer.compressor.ape",
            "layers.1.ffn.experts.7.w3.weight"} <= names
    assert not any(n.startswith("model.") for n in names)

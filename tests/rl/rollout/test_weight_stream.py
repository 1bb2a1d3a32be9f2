"""FP8-on-the-wire decoding and name resolution into a live HF model."""
import pytest
import torch

from rl.quant.wire import pack_fp8_for_wire, scale_name, unpack_fp8_from_wire
from rl.rollout.hf_weights import HFWeightTargets, UnknownWeightError
from rl.rollout.weights import decode_wire


def _wire(name, w):
    w8, scale = pack_fp8_for_wire(w)
    return (name, w8), (scale_name(name), scale)


def test_decode_wire_pairs_halves_in_any_order_and_passes_the_rest():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(128, 256, generator=g), torch.randn(64, 128, generator=g)
    norm = torch.randn(128, generator=g)
    (a_w, a_s), (b_w, b_s) = _wire("a.weight", a), _wire("b.weight", b)
    real_scale = ("c.weight_scale_inv", torch.ones(1, 1))  # its weight is not wire bytes
    stream = [a_w, ("norm.weight", norm), b_s, a_s, real_scale, b_w]
    out = list(decode_wire(stream, torch.float32))
    names = [n for n, _ in out]
    assert names == ["norm.weight", "a.weight", "b.weight", "c.weight_scale_inv"]
    got = dict(out)
    assert torch.equal(got["norm.weight"], norm)
    assert torch.equal(got["a.weight"], unpack_fp8_from_wire(a_w[1], a_s[1], dtype=torch.float32))
    assert got["b.weight"].dtype == torch.float32
    # FP8 keeps ~2 significant digits: the decoded weight is close, not equal.
    assert (got["a.weight"] - a).abs().max() <= a.abs().max() / 16
    assert not torch.equal(got["a.weight"], a)


def test_decode_wire_fails_for_bytes_without_scale():
    weight, _scale = _wire("a.weight", torch.randn(128, 128))
    with pytest.raises(ValueError, match="without their scales.*a.weight"):
        list(decode_wire([weight], torch.float32))


@pytest.fixture(scope="module")
def tiny_model():
    from rl.models.presets import build_model

    torch.set_num_threads(1)
    return build_model("tiny-qwen3-moe", seed=0)


def test_checkpoint_names_write_through_to_fused_experts(tiny_model, perturb):
    from rl.models.name_maps import checkpoint_state

    targets = HFWeightTargets(tiny_model)
    new = perturb(checkpoint_state(tiny_model), seed=1)
    assert any(".experts.3.gate_proj." in n for n, _ in new)  # per-expert checkpoint names
    assert targets.load(new) == len(new)
    now = dict(checkpoint_state(tiny_model))
    assert all(torch.equal(now[n], t) for n, t in new)


def test_in_memory_names_load_directly(tiny_model, perturb):
    targets = HFWeightTargets(tiny_model)
    new = perturb(list(tiny_model.state_dict().items()), seed=2)
    targets.load(new)
    state = tiny_model.state_dict()
    assert all(torch.equal(state[n], t) for n, t in new)


def test_unknown_names_and_wrong_shapes_are_errors(tiny_model):
    targets = HFWeightTargets(tiny_model)
    with pytest.raises(UnknownWeightError, match="model.layers.0.mlp.experts.99.gate_proj"):
        targets.copy_("model.layers.0.mlp.experts.99.gate_proj.weight", torch.zeros(1))
    with pytest.raises(ValueError, match="shape"):
        targets.copy_("model.norm.weight", torch.zeros(3))
    with pytest.raises(ValueError, match="shape"):
        targets.copy_("model.layers.0.mlp.experts.0.gate_proj.weight", torch.zeros(3, 3))


@pytest.mark.parametrize("expert_dtype", ["fp8", "fp4", None])
def test_a_v4_engine_takes_the_fp8_wire_only_with_fp8_experts(expert_dtype):
    """The receiver's decision for vLLM V4 engines (`launch.convert --rollout-experts fp8` writes
    `expert_dtype: fp8`; fp4 and a config without it, vLLM's default, hold MXFP4 experts)."""
    from types import SimpleNamespace

    from rl.rollout.weights import engine_loads_block_fp8

    hf = SimpleNamespace(model_type="deepseek_v4")
    if expert_dtype is not None:
        hf.expert_dtype = expert_dtype
    cfg = SimpleNamespace(
        quant_config=SimpleNamespace(is_checkpoint_fp8_serialized=True,
                                     weight_block_size=[128, 128]),
        model_config=SimpleNamespace(hf_config=hf))
    if expert_dtype == "fp8":
        assert engine_loads_block_fp8(cfg) is True
    else:
        with pytest.raises(ValueError, match=r"MXFP4 .*launch\.convert .*--rollout-experts fp8"):
            engine_loads_block_fp8(cfg)

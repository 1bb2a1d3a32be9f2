"""`rl.models.convert.layout`: the published form of each trained DeepSeek-V4 tensor, read from
the published checkpoint (`tests.helpers.v4_published`) or, without it, from the names."""
from __future__ import annotations

import json

import pytest
import torch

from rl.models.convert import open_source
from rl.models.convert.layout import TORCH_DTYPES, Form, Layout, LayoutError
from rl.models.name_maps import checkpoint_state
from rl.models.presets import build_model, build_preset
from tests.helpers.v4_published import FP4_RE, FP8_RE, write_published


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """(Source, {name: the trained-side tensor: dequantised fp32 or as stored})."""
    root = tmp_path_factory.mktemp("layout")
    preset = build_preset("tiny-deepseek-v4", root / "preset", seed=0)
    state = dict(checkpoint_state(build_model("tiny-deepseek-v4", seed=0)))
    config = json.loads((preset / "config.json").read_text())
    reference = write_published(state, config, preset, root / "published", mtp=True)
    return open_source(root / "published"), reference


def _trained(reference: dict) -> dict[str, torch.Tensor]:
    return {n: t for n, t in reference.items() if not n.startswith("mtp.")}


def test_the_source_decides_every_form(published):
    src, reference = published
    layout = Layout(src)
    assert layout.experts == "fp4" and layout.as_source
    for name, t in _trained(reference).items():
        form = layout.form(name, t)
        if FP8_RE.search(name) or FP4_RE.search(name):
            assert form == Form("fp8" if FP8_RE.search(name) else "fp4",
                                torch.float8_e8m0fnu), name
        else:
            assert form == Form("plain", t.dtype), name
        out = dict(layout.tensors(name, t))
        assert {n: (v.dtype, tuple(v.shape)) for n, v in out.items()} == \
            {n: (TORCH_DTYPES[src.dtype_shape(n)[0]], src.dtype_shape(n)[1]) for n in out}, name
    assert layout.expected() == set(_trained(reference))
    assert layout.mtp_names() and all(n.startswith("mtp.") for n in layout.mtp_names())
    assert layout.config({}) == src.config


def test_fp8_experts_take_fp32_scales_everywhere(published):
    src, reference = published
    layout = Layout(src, "fp8")
    assert not layout.as_source
    for name, t in _trained(reference).items():
        form = layout.form(name, t)
        if FP8_RE.search(name) or FP4_RE.search(name):
            assert form == Form("fp8", torch.float32), name
    assert layout.config({})["expert_dtype"] == "fp8"


def test_without_a_source_the_names_give_the_published_forms(published):
    src, reference = published
    by_source, by_name = Layout(src), Layout(None)
    for name, t in _trained(reference).items():
        assert by_name.form(name, t) == by_source.form(name, t), name
    config = by_name.config({"model_type": "deepseek_v4", "dtype": "bfloat16",
                             "expert_dtype": "bf16"})
    assert config["expert_dtype"] == "fp4" and "dtype" not in config
    assert config["quantization_config"]["weight_block_size"] == [128, 128]


def test_what_does_not_fit_is_refused(published):
    src, reference = published
    layout = Layout(src)
    with pytest.raises(LayoutError, match=r"layers\.9\.attn\.wq_a\.weight is not a tensor of"):
        layout.form("layers.9.attn.wq_a.weight", torch.zeros(2, 2))
    with pytest.raises(LayoutError, match=r"layers\.0\.attn\.wq_a\.scale is not a tensor of"):
        layout.form("layers.0.attn.wq_a.scale", torch.zeros(1, 1))
    w = reference["layers.0.attn.wq_a.weight"].clone()
    with pytest.raises(LayoutError, match=r"wq_a\.weight: shape .* in the checkpoint, "):
        layout.form("layers.0.attn.wq_a.weight", w[:, :-1])
    w[1, 2] = float("nan")
    with pytest.raises(LayoutError, match=r"^layers\.0\.attn\.wq_a\.weight: nan at index "
                                          r"\[1, 2\]: inf / NaN cannot be quantised"):
        layout.tensors("layers.0.attn.wq_a.weight", w)
    with pytest.raises(LayoutError, match=r"experts 'int4', expected one of fp4, fp8"):
        Layout(src, "int4")

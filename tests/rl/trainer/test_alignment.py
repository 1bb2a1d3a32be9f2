"""Expert weights as views into a DeepSpeed-style flat buffer: the trainer's experts run
grouped_mm while every operand is 16-byte aligned and batched_mm (same outputs) when one is not
(on CUDA, grouped_mm refuses misaligned operands: "expected data_ptr to be aligned to 16
bytes"). The check itself is device-independent, so it runs here on CPU."""
import pytest
import torch

from rl.trainer import alignment


@pytest.fixture(scope="module")
def preset_dirs(tmp_path_factory):
    from rl.models.presets import build_preset
    root = tmp_path_factory.mktemp("presets")
    return {name: build_preset(name, root / name, seed=0)
            for name in ("tiny-deepseek-v4", "tiny-qwen3-moe")}


def _flatten(model, lead: int) -> None:
    """Every parameter a view into one buffer, after `lead` elements, in order, no padding (as
    ZeRO lays out the parameters it gathers)."""
    params = list(model.parameters())
    flat = torch.empty(lead + sum(p.numel() for p in params))
    at = lead
    for p in params:
        flat[at:at + p.numel()].copy_(p.data.reshape(-1))
        p.data = flat[at:at + p.numel()].view_as(p)
        at += p.numel()


@pytest.fixture
def calls(monkeypatch):
    """Which experts function each call ran."""
    seen = []
    for name in ("grouped_mm_experts_forward", "batched_mm_experts_forward"):
        real = getattr(alignment, name)
        monkeypatch.setattr(alignment, name, lambda *a, _r=real, _n=name, **k: (
            seen.append(_n.split("_experts")[0]), _r(*a, **k))[1])
    return seen


def test_odd_sized_parameters_misalign_the_experts_which_fall_back(preset_dirs, calls):
    from rl.models import v4_layer
    from rl.models.loading import load_model

    model = load_model(preset_dirs["tiny-deepseek-v4"], torch.float32)
    # load_model gives V4 rl.models.v4_layer's experts, which check alignment themselves (a
    # per-expert loop where misaligned); transformers' grouped_mm is what `alignment` wraps
    v4_layer.restore(model, experts="grouped_mm")
    ids = torch.randint(3, 60, (2, 24))
    with torch.no_grad():
        want = model(ids).logits
    assert alignment.install(model)
    assert model.config._experts_implementation == alignment.IMPLEMENTATION
    with torch.no_grad():
        model(ids)
    assert set(calls) == {"grouped_mm"}
    calls.clear()
    _flatten(model, lead=0)  # V4's hyper-connection `scale` (3 elements) shifts what follows
    with torch.no_grad():
        got = model(ids).logits
    assert "batched_mm" in calls
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_aligned_views_keep_grouped_mm(preset_dirs, calls):
    from rl.models.loading import load_model

    model = load_model(preset_dirs["tiny-qwen3-moe"], torch.float32)
    _flatten(model, lead=4)  # Qwen3-MoE: every size a multiple of 4 elements
    assert alignment.install(model)
    with torch.no_grad():
        model(torch.randint(3, 60, (2, 24)))
    assert calls and set(calls) == {"grouped_mm"}


def test_models_without_grouped_mm_are_left_alone(preset_dirs):
    from rl.models.loading import load_model

    model = load_model(preset_dirs["tiny-qwen3-moe"], torch.float32)
    model.set_experts_implementation("batched_mm")
    assert not alignment.install(model)
    assert model.config._experts_implementation == "batched_mm"

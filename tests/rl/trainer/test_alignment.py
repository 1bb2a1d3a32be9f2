"""Expert weights as views into a DeepSpeed-style flat buffer: the trainer's experts run
grouped_mm on the views while every operand is 16-byte aligned, and on aligned copies (same
outputs, gradients back to the views) when one is not (on CUDA, grouped_mm refuses misaligned
operands: "expected data_ptr to be aligned to 16 bytes"). The check itself is
device-independent, so it runs here on CPU."""
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
    """Each grouped_mm call: whether its operands (the weights it read, the hidden states) were
    all 16-byte aligned."""
    seen = []
    real = alignment.grouped_mm_experts_forward

    def spy(module, hidden_states, *a, **k):
        weights = [getattr(module, n) for n in ("gate_up_proj", "down_proj")]
        seen.append(all(t.data_ptr() % 16 == 0 for t in (*weights, hidden_states)))
        return real(module, hidden_states, *a, **k)
    monkeypatch.setattr(alignment, "grouped_mm_experts_forward", spy)
    return seen


def _v4_with_grouped_mm(preset_dirs):
    from rl.models import v4_layer
    from rl.models.loading import load_model
    model = load_model(preset_dirs["tiny-deepseek-v4"], torch.float32)
    # load_model gives V4 rl.models.v4_layer's experts, which check alignment themselves (a
    # per-expert loop where misaligned); transformers' grouped_mm is what `alignment` wraps
    v4_layer.restore(model, experts="grouped_mm")
    return model


def _experts(model) -> list:
    return [m for m in model.modules() if hasattr(m, "gate_up_proj")]


def test_misaligned_experts_run_grouped_mm_on_aligned_copies(preset_dirs, calls):
    ids = torch.randint(3, 60, (2, 24))
    ref = _v4_with_grouped_mm(preset_dirs)
    ref(ids).logits.square().mean().backward()
    model = _v4_with_grouped_mm(preset_dirs)
    assert alignment.install(model)
    assert model.config._experts_implementation == alignment.IMPLEMENTATION
    with torch.no_grad():
        model(ids)
    assert calls and all(calls)
    calls.clear()
    _flatten(model, lead=0)  # V4's hyper-connection `scale` (3 elements) shifts what follows
    hidden = torch.empty(4)
    assert any(alignment.misaligned(m, hidden) for m in _experts(model))
    got = model(ids).logits
    got.square().mean().backward()
    assert calls and all(calls)  # every grouped_mm call saw aligned operands: the copies
    torch.testing.assert_close(got, ref(ids).logits, rtol=1e-4, atol=1e-4)
    for mine, theirs in zip(_experts(model), _experts(ref), strict=True):
        for name in ("gate_up_proj", "down_proj"):  # the gradient reached the flat views
            torch.testing.assert_close(getattr(mine, name).grad, getattr(theirs, name).grad,
                                       rtol=1e-4, atol=1e-6)


def test_aligned_views_keep_grouped_mm(preset_dirs, calls):
    from rl.models.loading import load_model

    model = load_model(preset_dirs["tiny-qwen3-moe"], torch.float32)
    _flatten(model, lead=4)  # Qwen3-MoE: every size a multiple of 4 elements
    assert alignment.install(model)
    with torch.no_grad():
        model(torch.randint(3, 60, (2, 24)))
    assert calls and all(calls)


def test_models_without_grouped_mm_are_left_alone(preset_dirs):
    from rl.models.loading import load_model

    model = load_model(preset_dirs["tiny-qwen3-moe"], torch.float32)
    model.set_experts_implementation("batched_mm")
    assert not alignment.install(model)
    assert model.config._experts_implementation == "batched_mm"

"""rl.models.v4_attention at V4-Flash's real attention dims (64 heads x 512, one K=V head,
window 128, CSA top-512 of rate-4 entries, HCA rate 128) on a GPU, in BF16, against
transformers' eager attention: outputs and every gradient of one layer's forward + backward."""
import pytest
import torch

from bench.v4_attention import build_layer, run_layer, v4_config

pytestmark = pytest.mark.gpu


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("layer", ["csa", "hca"])
def test_flash_dims_match_eager(layer, report):
    attn, rotary = build_layer(v4_config(), layer, "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    # 4,096 tokens: 1,024 CSA entries, so the top-512 really selects
    hidden = torch.randn(1, 4096, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    grad = torch.randn(1, 4096, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    results = {}
    for impl in ("eager", "triton", "torch"):
        attn.zero_grad()
        x = hidden.clone().requires_grad_()
        out = run_layer(attn, rotary, x, impl)
        out.backward(grad)
        grads = {n: p.grad.clone() for n, p in attn.named_parameters() if p.grad is not None}
        results[impl] = (out.detach(), x.grad, grads)
    want_out, want_dx, want_grads = results["eager"]
    assert "sinks" in want_grads and "compressor.kv_proj.weight" in want_grads
    for impl in ("triton", "torch"):
        out, dx, grads = results[impl]
        assert grads.keys() == want_grads.keys()
        errors = {"output": _rel(out, want_out), "d_hidden": _rel(dx, want_dx)}
        errors.update({f"d_{n}": _rel(grads[n], want_grads[n]) for n in want_grads})
        worst = max(errors, key=errors.get)
        report(f"v4_attention_{layer}_{impl}", worst=worst, **{k: round(v, 5) for k, v in
                                                              errors.items()})
        # bf16: eager rounds its scores and probabilities to bf16; ours keeps them in fp32
        assert errors[worst] < 2e-2, (impl, worst, errors[worst])

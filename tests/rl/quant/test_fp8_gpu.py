"""CUDA block-FP8 backend against the torch reference (H200 / sm_90+; skipped without CUDA)."""
import warnings

import pytest
import torch
from torch import nn

from rl.quant import backends
from rl.quant.backends import fp8_linear, select_backend
from rl.quant.block_fp8 import quantize_weight_block
from rl.quant.modules import FP8Experts, FP8Linear, swap_linears

pytestmark = pytest.mark.gpu


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_cuda_backend_is_selected():
    assert select_backend("cuda") == "cuda"


@pytest.mark.parametrize("m, k, n", [(64, 4096, 4096), (7, 256, 384),   # the brief's shapes
                                     (1, 512, 256), (5, 384, 272),       # M padded to 4, K/128 to 4
                                     (4, 128, 128), (33, 400, 144)])     # K, N not multiples of 128
def test_cuda_matches_torch_reference(m, k, n):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=g)
    b = torch.randn(n, device="cuda", generator=g, dtype=torch.bfloat16)
    w8, s = quantize_weight_block(w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # these shapes must take the kernel, not the fallback
        y = fp8_linear(x, w8, s, b, "cuda")
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = fp8_linear(x, w8, s, b, "torch", act_quant=True)   # same quantised inputs, fp32 math
    assert rel_err(y, ref) < 1e-2                             # bf16 output rounding only
    assert rel_err(y, x.float() @ w.t() + b.float()) < 0.05


def test_cuda_unsupported_shape_falls_back():
    backends._warned.clear()
    x = torch.randn(4, 200, device="cuda")
    w8, s = quantize_weight_block(torch.randn(256, 200, device="cuda"))
    with pytest.warns(RuntimeWarning, match="cannot take K=200"):
        y = fp8_linear(x, w8, s, backend="cuda")
    torch.testing.assert_close(y, fp8_linear(x, w8, s, backend="torch", act_quant=True))


def test_fp8_linear_module_on_cuda():
    torch.manual_seed(0)
    lin = nn.Linear(1024, 768, device="cuda", dtype=torch.bfloat16)
    q = FP8Linear.from_linear(lin, backend="cuda")
    x = torch.randn(2, 3, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y = q(x)
        assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 768)
        assert rel_err(y, lin(x)) < 0.05
        other = nn.Linear(1024, 768, device="cuda", dtype=torch.bfloat16)
        ptr = q.weight_fp8.data_ptr()
        q.load_bf16_weight(other.weight, other.bias)
        assert q.weight_fp8.data_ptr() == ptr
        assert rel_err(q(x), other(x)) < 0.05


def test_swap_linears_on_cuda(tiny_qwen3_moe):
    model = tiny_qwen3_moe.to("cuda", torch.bfloat16)
    ids = torch.randint(0, 256, (2, 12), device="cuda")
    with torch.no_grad():
        ref = model(ids).logits.float()
        report = swap_linears(model, backend="auto")
        out = model(ids).logits.float()
    assert model.model.layers[0].self_attn.q_proj.backend == "cuda"
    assert isinstance(model.model.layers[0].mlp.experts, FP8Experts)
    assert len(report.quantized) == 13
    assert rel_err(out, ref) < 0.1


@pytest.mark.parametrize("shape", [(1024, 1024), (4, 384, 640), (300, 200)])
def test_block_quantisation_is_the_same_bits_on_cpu_cuda_and_triton(shape, report):
    """The sync's wire bytes are checked against a CPU reference: the torch reference on the CPU,
    the same on CUDA, and the Triton kernel of the sync must agree bit for bit (bytes and scales).
    A weight drawn in bf16, as the trainer holds it."""
    from rl.quant.fast_quant import quantize_weight_fast

    g = torch.Generator().manual_seed(1)
    w = (0.02 * torch.randn(shape, generator=g)).bfloat16()
    q_cpu, s_cpu = quantize_weight_block(w)
    q_cuda, s_cuda = quantize_weight_block(w.cuda())
    q_tri, s_tri = quantize_weight_fast(w.cuda())
    agree = {"scale_cuda": (s_cuda.cpu() == s_cpu).float().mean().item(),
             "scale_triton": (s_tri.cpu() == s_cpu).float().mean().item(),
             "bytes_cuda": (q_cuda.cpu().view(torch.uint8) == q_cpu.view(torch.uint8)).float().mean().item(),
             "bytes_triton": (q_tri.cpu() == q_cpu.view(torch.uint8)).float().mean().item()}
    report("fp8_quant_cpu_vs_gpu", shape=list(shape), **agree)
    assert all(v == 1.0 for v in agree.values()), agree

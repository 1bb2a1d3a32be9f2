"""Backend dispatch and the torch reference GEMM.

The ROCm/AITER and Hopper cases cannot run on this CPU machine: their dispatch tests patch
`torch.version.hip`, `torch.cuda.*` and put a STAND-IN `aiter` module into sys.modules. They
test only which backend is chosen; the kernels themselves run in test_fp8_gpu.py (CUDA) or
not at all (AITER: no AMD GPU available).
"""
import importlib.util
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from rl.quant import backends
from rl.quant.backends import (
    BackendUnavailableError, cuda_shape_unsupported_reason, fp8_linear, select_backend, vllm_aiter_env,
)
from rl.quant.block_fp8 import dequantize_weight_block, quantize_act_group, quantize_weight_block


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_cpu_selects_torch_and_rejects_gpu_backends():
    assert select_backend("cpu") == "torch"
    assert select_backend("cpu", "torch") == "torch"
    with pytest.raises(BackendUnavailableError, match="'cuda' cannot run on cpu: device cpu is not a CUDA"):
        select_backend("cpu", "cuda")
    with pytest.raises(BackendUnavailableError, match="not a ROCm build"):
        select_backend("cpu", "aiter")
    with pytest.raises(ValueError, match="expected one of auto, aiter, cuda, torch"):
        select_backend("cpu", "triton")


@pytest.fixture
def rocm_stand_in(monkeypatch):
    """STAND-IN for a ROCm machine with AITER (dispatch logic only; nothing is computed)."""
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fake = types.ModuleType("aiter")
    fake.gemm_a8w8_blockscale = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "aiter", fake)
    return fake


def test_rocm_with_aiter_selects_aiter(rocm_stand_in):
    assert select_backend("cuda:0") == "aiter"
    assert select_backend("cuda:0", "aiter") == "aiter"
    with pytest.raises(BackendUnavailableError, match="ROCm build"):
        select_backend("cuda:0", "cuda")
    assert select_backend("cpu") == "torch"   # CPU tensors never go to a GPU kernel


def test_rocm_without_usable_aiter_falls_back_to_torch(rocm_stand_in, monkeypatch):
    del rocm_stand_in.gemm_a8w8_blockscale
    assert select_backend("cuda:0") == "torch"
    with pytest.raises(BackendUnavailableError, match="no gemm_a8w8_blockscale"):
        select_backend("cuda:0", "aiter")
    monkeypatch.setitem(sys.modules, "aiter", None)   # makes `import aiter` raise ImportError
    with pytest.raises(BackendUnavailableError, match="not importable"):
        select_backend("cuda:0", "aiter")


@pytest.mark.parametrize("capability, cuda, expected", [
    ((9, 0), "13.0", "cuda"), ((9, 0), "12.9", "cuda"),
    ((9, 0), "12.8", "CUDA 12.8; block-wise scaled_mm needs 12.9+"),
    ((10, 0), "13.0", "sm_100; torch's block-wise FP8 scaled_mm runs on sm_90 only"),
    ((8, 9), "13.0", "sm_89; torch's block-wise FP8 scaled_mm runs on sm_90 only")])
def test_cuda_capability_dispatch(monkeypatch, capability, cuda, expected):
    """STAND-IN for a CUDA machine: only the capability and CUDA-version checks are exercised
    (torch offers the 1x128 x 128x128 recipe on sm_90 with CUDA 12.9+)."""
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.version, "cuda", cuda, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    if expected == "cuda":
        assert select_backend("cuda:0") == "cuda"
        return
    assert select_backend("cuda:0") == "torch"
    with pytest.raises(BackendUnavailableError, match=re.escape(expected)):
        select_backend("cuda:0", "cuda")


def make_problem(m=6, k=300, n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)


def test_torch_backend_matches_fp32_matmul():
    x, w, b = make_problem()
    w8, s = quantize_weight_block(w)
    y = fp8_linear(x, w8, s, b, "torch")
    assert y.shape == (6, 200) and y.dtype == torch.float32
    assert 1e-3 < rel_err(y, x @ w.t() + b) < 0.04
    exact = x @ dequantize_weight_block(w8, s, dtype=torch.float32).t() + b
    torch.testing.assert_close(y, exact, rtol=1e-5, atol=1e-5)


def test_torch_backend_act_quant_emulates_gpu_numerics():
    x, w, _ = make_problem(seed=1)
    w8, s = quantize_weight_block(w)
    y = fp8_linear(x, w8, s, None, "torch", act_quant=True)
    x8, sx = quantize_act_group(x)
    xq = x8.float() * sx.repeat_interleave(128, -1)[:, :300]
    torch.testing.assert_close(y, xq @ dequantize_weight_block(w8, s, dtype=torch.float32).t())
    assert rel_err(y, x @ w.t()) < 0.05


def test_leading_dims_and_dtype():
    x, w, b = make_problem(m=6)
    w8, s = quantize_weight_block(w)
    y = fp8_linear(x.reshape(2, 3, 300).bfloat16(), w8, s, b.bfloat16(), "torch")
    assert y.shape == (2, 3, 200) and y.dtype == torch.bfloat16
    assert fp8_linear(x, w8, s, out_dtype=torch.bfloat16).dtype == torch.bfloat16


def test_fp8_linear_rejects_bad_arguments():
    x, w, _ = make_problem()
    w8, s = quantize_weight_block(w)
    with pytest.raises(ValueError, match="w8 must be a 2-D"):
        fp8_linear(x, w, s)
    with pytest.raises(ValueError, match="K=299"):
        fp8_linear(x[:, :299], w8, s)
    with pytest.raises(ValueError, match="needs CUDA/ROCm tensors"):
        fp8_linear(x, w8, s, backend="cuda")
    with pytest.raises(ValueError, match="expected one of"):
        fp8_linear(x, w8, s, backend="auto")


def test_cuda_shape_rules():
    assert cuda_shape_unsupported_reason(7, 256, 384, 128) is None
    assert cuda_shape_unsupported_reason(1, 4096, 4096, 128) is None
    assert "multiples of 16" in cuda_shape_unsupported_reason(64, 200, 256, 128)
    assert "multiples of 16" in cuda_shape_unsupported_reason(64, 256, 200, 128)
    assert "128 only" in cuda_shape_unsupported_reason(64, 256, 256, 64)


def test_vllm_aiter_env():
    on, off = vllm_aiter_env(True), vllm_aiter_env(False)
    assert on["VLLM_ROCM_USE_AITER"] == "1" and on["VLLM_ROCM_USE_AITER_MOE"] == "1"
    assert on["VLLM_ROCM_USE_AITER_LINEAR"] == "1"
    assert set(on) == set(off) and set(off.values()) == {"0"}


def test_vllm_aiter_env_names_exist_in_installed_vllm():
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vllm is not installed here")
    text = (Path(spec.origin).parent / "envs.py").read_text()   # read, not import (import takes ~7 s)
    defined = set(re.findall(r'^\s+"(VLLM_[A-Z0-9_]+)":', text, flags=re.M))
    assert "VLLM_ROCM_USE_AITER" in defined
    assert set(vllm_aiter_env(True)) <= defined


def test_unsupported_shape_falls_back_with_one_warning(monkeypatch):
    """The fallback branch, exercised on CPU by calling the private dispatch helper directly."""
    backends._warned.clear()
    x, w, _ = make_problem(k=200)
    w8, s = quantize_weight_block(w)
    assert cuda_shape_unsupported_reason(6, 200, 200, 128) is not None
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # STAND-IN: pretend GPU
    with pytest.warns(RuntimeWarning, match="cannot take K=200"):
        y = fp8_linear(x, w8, s, backend="cuda")
    torch.testing.assert_close(y, fp8_linear(x, w8, s, backend="torch", act_quant=True))

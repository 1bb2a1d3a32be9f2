"""Block-FP8 GEMM backends chosen at run time: AITER (ROCm), CUDA (torch scaled_mm), torch.

`fp8_linear(x, w8, w_scale)` computes `x @ deq(w8, w_scale).T + bias` for DeepSeek-layout
weights (`w8` (N, K) e4m3fn, `w_scale` (ceil(N/128), ceil(K/128)) fp32, see `block_fp8`):

- `torch`: reference; dequantises the weight and matmuls in fp32. Runs anywhere (CPU tests).
  With `act_quant=True` it also round-trips the activations through 1x128 FP8 groups, which
  reproduces the GPU backends' numerics up to accumulation order.
- `cuda`: `torch.nn.functional.scaled_mm` with (BlockWise1x128, BlockWise128x128) scaling,
  cuBLASLt on sm_90 with CUDA >= 12.9 (verified on H200, torch 2.11; PyTorch offers this recipe
  for sm_90 only). Activations are quantised per 1x128 group on the fly by one Triton pass
  (`fast_quant.quantize_act_fast`); `block_scaled_mm` takes activations a producer kernel
  already quantised (the native engine's fused RMSNorm / SiLU).
- `aiter`: `aiter.gemm_a8w8_blockscale` on ROCm (MI300/MI325/MI355). NOT RUN in this project's
  CI or on its GPU machine (no AMD GPU available); written from vLLM's use of the same kernel
  (`vllm/_aiter_ops.py`). Only its dispatch logic is tested, with a stand-in module.

`select_backend` picks the first that can run (aiter, cuda, torch); an explicit preference that
cannot run raises `BackendUnavailableError` saying why.

Speed (H200, torch 2.11): with torch ops for the activation quantisation (~100-180 us at
M=64, K=4096) this path was slower than a BF16 matmul at every size measured; with the Triton
quantiser, cuBLAS's block-scaled GEMM plus quantisation runs at 0.52-0.86x cuBLAS BF16 at
Qwen3-0.6B's decode shapes and 0.81-1.00x at a Qwen3-30B-sized 4096 x 8192
(`bench/results/fp8_gemm.md`, 64 and 256 rows).
"""
from __future__ import annotations

import importlib
import warnings

import torch
import torch.nn.functional as F

from rl.quant.block_fp8 import (
    DEFAULT_BLOCK, FP8_DTYPE, dequantize_act_group, dequantize_weight_block, fp8_e4m3fn_to_fnuz,
    quantize_act_group,
)
from rl.quant.fast_quant import QuantAct, quantize_act_fast

BACKENDS = ("aiter", "cuda", "torch")
PREFERENCES = ("auto", *BACKENDS)


class BackendUnavailableError(ValueError):
    """An explicitly requested FP8 backend cannot run on this device / build."""


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _as_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _import_aiter():
    return importlib.import_module("aiter")


def aiter_unavailable_reason(device: torch.device | str | None) -> str | None:
    """None if AITER can run on `device`, else a one-line reason."""
    device = _as_device(device)
    if not getattr(torch.version, "hip", None):
        return "torch is not a ROCm build (torch.version.hip is None)"
    if device.type != "cuda":  # type: ignore[union-attr]  # lint baseline (issue 39)
        return f"device {device} is not a GPU (ROCm GPUs are torch 'cuda' devices)"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    try:
        aiter = _import_aiter()
    except ImportError as exc:
        return f"the 'aiter' package is not importable ({exc})"
    if not hasattr(aiter, "gemm_a8w8_blockscale"):
        return "this aiter build has no gemm_a8w8_blockscale"
    return None


def cuda_unavailable_reason(device: torch.device | str | None) -> str | None:
    """None if torch's block-wise scaled_mm can run on `device`, else a one-line reason."""
    device = _as_device(device)
    if getattr(torch.version, "hip", None):
        return "torch is a ROCm build; block-wise scaled_mm is CUDA-only (use 'aiter')"
    if device.type != "cuda":  # type: ignore[union-attr]  # lint baseline (issue 39)
        return f"device {device} is not a CUDA device"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    if not (hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm / ScalingType"
    major, minor = torch.cuda.get_device_capability(device)
    # cuBLASLt's 1x128 / 128x128 block scaling: torch's own samples for it run on major 9 with
    # CUDA >= 12.9 only (torch/testing/_internal/common_methods_invocations.py, pytorch#172227).
    # Ada has FP8 tensor cores but only tensor-/row-wise scaling; Blackwell takes MX formats.
    if major != 9:
        return f"GPU is sm_{major}{minor}; torch's block-wise FP8 scaled_mm runs on sm_90 only"
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    if cuda < (12, 9):
        return f"torch is built with CUDA {torch.version.cuda}; block-wise scaled_mm needs 12.9+"
    return None


def select_backend(device: torch.device | str | None = None, preference: str = "auto") -> str:
    """Return "aiter", "cuda" or "torch" for `device` (None: cuda:0 if present, else cpu).

    `preference="auto"` takes the first of aiter, cuda, torch that can run. An explicit
    preference that cannot run raises `BackendUnavailableError` with the reason.
    """
    if preference not in PREFERENCES:
        raise ValueError(f"fp8 backend: got {preference!r}, expected one of {', '.join(PREFERENCES)}")
    checks = {"aiter": aiter_unavailable_reason, "cuda": cuda_unavailable_reason,
              "torch": lambda _device: None}
    if preference != "auto":
        reason = checks[preference](device)
        if reason is not None:
            raise BackendUnavailableError(f"fp8 backend {preference!r} cannot run on "
                                          f"{_as_device(device)}: {reason}")
        return preference
    for name in BACKENDS:
        if checks[name](device) is None:
            return name
    raise AssertionError("unreachable: the torch backend always runs")


# --------------------------------------------------------------------------------------
# The GEMMs
# --------------------------------------------------------------------------------------
def _linear_torch(x2: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, block: int,
                  act_quant: bool) -> torch.Tensor:
    if act_quant:
        x32 = dequantize_act_group(*quantize_act_group(x2, block), block, torch.float32)
    else:
        x32 = x2.float()
    return x32 @ dequantize_weight_block(w8, w_scale, block, torch.float32).t()


def cuda_shape_unsupported_reason(m: int, k: int, n: int, block: int) -> str | None:
    """Why (M, K, N) cannot take the cuBLASLt block-wise path (None if it can).

    torch checks K % 16 == 0 and N % 16 == 0 (FP8 operand alignment); the recipe is fixed at
    128-element blocks. K and N need not be multiples of 128 (measured on H200, torch 2.11:
    K=400, N=144 match the reference). Any M works: `_linear_cuda` pads M to a multiple of 4.
    """
    if block != 128:
        return f"block {block} (cuBLASLt block scaling is 128 only)"
    if k % 16 or n % 16:
        return f"K={k}, N={n} (both must be multiples of 16)"
    return None


def block_scaled_mm(act: QuantAct, w8: torch.Tensor, w_scale: torch.Tensor,
                    out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`act` (M' rows, M' % 4 == 0) @ deq(w8 (N, K), w_scale).T -> (M, N) on cuBLASLt's
    block-scaled FP8 GEMM (see `cuda_unavailable_reason`); the padding rows are cut off."""
    kb = act.scale.shape[1]
    # scale_b is passed transposed, shape (round_up(K/128, 4), N/128), strides (1, round_up(...)):
    # torch's check pads the K-block count to a multiple of 4; the padding is never read.
    kb4 = -(-kb // 4) * 4
    sw = w_scale if kb4 == kb else F.pad(w_scale, (0, kb4 - kb), value=1.0)
    sw = sw.contiguous()  # (N/128, kb4) row-major, so sw.t() has strides (1, kb4)
    st = F.ScalingType
    y = F.scaled_mm(act.q, w8.contiguous().t(), act.scale, st.BlockWise1x128, sw.t(),
                    st.BlockWise128x128, output_dtype=out_dtype)
    return y if y.shape[0] == act.rows else y[:act.rows]


def _linear_cuda(x2: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    # cuBLASLt answers CUBLAS_STATUS_NOT_SUPPORTED unless M % 4 == 0 (measured on H200 for
    # M = 1, 7; 4, 8, 16, 64 work): the column-major activation scales need 16-byte columns.
    # The quantiser pads with zero rows.
    return block_scaled_mm(quantize_act_fast(x2, rows_multiple=4), w8, w_scale)


def _linear_aiter(x2: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    # UNTESTED on hardware (no AMD GPU here); mirrors vLLM's AiterFp8BlockScaledMMKernel:
    # A (M, K) fp8, B (N, K) fp8, As (M, K/128) row-major fp32, Bs (N/128, K/128) fp32.
    from aiter import gemm_a8w8_blockscale

    a8, sa = quantize_act_group(x2, 128)
    arch = getattr(torch.cuda.get_device_properties(x2.device), "gcnArchName", "")
    if arch.startswith("gfx94"):  # MI300/MI325 use e4m3fnuz
        a8, sa = fp8_e4m3fn_to_fnuz(a8, sa)
        w8, w_scale = fp8_e4m3fn_to_fnuz(w8, w_scale)
    return gemm_a8w8_blockscale(a8.contiguous(), w8.contiguous(), sa.contiguous(),
                                w_scale.contiguous(), dtype=torch.bfloat16)


def fp8_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None, backend: str = "torch", *,
               block: int = DEFAULT_BLOCK, act_quant: bool | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`y (..., N) = x (..., K) @ deq(w8 (N, K), w_scale).T + bias`.

    `backend` is a resolved name ("torch", "cuda", "aiter"; see `select_backend`).
    `act_quant`: quantise activations per 1x128 group first; the GPU backends always do
    (None = backend default: False for torch, True otherwise). `out_dtype` defaults to x.dtype;
    GPU backends compute in bf16 and cast. A shape the GPU kernel cannot take falls back to the
    torch reference with a warning (once per shape and backend).
    """
    if backend not in BACKENDS:
        raise ValueError(f"fp8_linear backend: got {backend!r}, expected one of {BACKENDS}")
    if w8.dtype != FP8_DTYPE or w8.dim() != 2:
        raise ValueError(f"fp8_linear: w8 must be a 2-D {FP8_DTYPE} tensor, got {w8.dtype} "
                         f"{tuple(w8.shape)}")
    n, k = w8.shape
    if x.shape[-1] != k:
        raise ValueError(f"fp8_linear: x has K={x.shape[-1]}, weight expects K={k}")
    out_dtype = out_dtype or x.dtype
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]

    if backend != "torch":
        if not x.is_cuda:
            raise ValueError(f"fp8_linear backend {backend!r} needs CUDA/ROCm tensors, "
                             f"x is on {x.device}")
        if act_quant is False:
            raise ValueError(f"fp8_linear backend {backend!r} always quantises activations; "
                             "act_quant=False is only possible with the torch backend")
        reason = cuda_shape_unsupported_reason(m, k, n, block)
        if reason is not None or m == 0:
            if m:
                _warn_once(f"{backend}:{k}:{n}:{block}",
                           f"fp8_linear: {backend} kernel cannot take {reason}; using the torch "
                           "reference for this shape (slow)")
            backend, act_quant = "torch", True

    if backend == "torch":
        y = _linear_torch(x2, w8, w_scale, block, bool(act_quant))
    elif backend == "cuda":
        y = _linear_cuda(x2, w8, w_scale)
    else:
        y = _linear_aiter(x2, w8, w_scale)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(out_dtype).reshape(*lead, n)


# --------------------------------------------------------------------------------------
# vLLM on ROCm
# --------------------------------------------------------------------------------------
_VLLM_AITER_SWITCHES = (
    "VLLM_ROCM_USE_AITER",          # master switch: every other flag is ANDed with it
    "VLLM_ROCM_USE_AITER_LINEAR",   # block-scale FP8 GEMMs (gemm_a8w8_blockscale)
    "VLLM_ROCM_USE_AITER_MOE",      # fused MoE
    "VLLM_ROCM_USE_AITER_RMSNORM",
    "VLLM_ROCM_USE_AITER_MHA",
    "VLLM_ROCM_USE_AITER_MLA",      # DeepSeek attention
)


def vllm_aiter_env(enabled: bool) -> dict[str, str]:
    """Environment for vLLM's AITER kernels on ROCm (names from vllm/envs.py, vllm 0.32).

    Set every switch explicitly either way, so a value inherited from the caller's shell can
    neither turn AITER on nor leave half of it on.
    """
    value = "1" if enabled else "0"
    return {name: value for name in _VLLM_AITER_SWITCHES}


def vllm_engine_env(use_aiter: bool, is_rocm: bool) -> dict[str, str]:
    """What the vLLM engine process exports for `rollout.use_aiter` on this platform.

    On ROCm every AITER switch is set explicitly (`vllm_aiter_env`), on or off. Elsewhere
    nothing (AITER does not exist there; the engine warns if `use_aiter` was asked for). NOT RUN
    on ROCm in this project (no AMD GPU): only the variables are tested, against vllm/envs.py.
    (`VLLM_ROCM_USE_AITER_MOE_A4W4_DSV4`, the FP4-expert kernel, is left alone: vLLM 0.32 has
    validated it for `deepseek_v41` only.)
    """
    return vllm_aiter_env(use_aiter) if is_rocm else {}

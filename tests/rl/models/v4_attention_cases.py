"""Cases shared by the CPU (Triton interpreter) and GPU tests of `rl.models.v4_attention`'s
Triton path: random inputs for one layer kind, and one implementation's output and gradients."""
from __future__ import annotations

import torch

IMPLS = {"chunked": ("torch", "triton"), "triton": ("triton", "triton"),
         "triton_one_pass": ("triton", "triton_one_pass"), "triton_torch_bwd": ("triton", "torch")}
"""name -> (kernel.FORCE, kernel.BACKWARD): the chunked torch path, the Triton forward with the
two-pass Triton backward (the default), with the one-pass one, with the per-block torch recompute
backward."""
NAMES = ["out", "dq", "dkv", "dcomp", "dsinks"]


def make_case(mode: str, B=2, H=4, S=29, D=32, rate=4, K=3, window=6, seed=4) -> dict:
    """fp32 inputs of one `mode` (csa, hca or sliding) layer, every value exact in bf16. The
    second sequence is padded from 3/4 of S on; CSA picks K distinct causal entries (-1 past
    the causal limit), HCA sees entries below (i + 1) // rate."""
    g = torch.Generator().manual_seed(seed)
    T = S // rate

    def randn(*shape):
        return torch.randn(*shape, generator=g).bfloat16().float()
    thr = ((torch.arange(S) + 1) // rate).expand(B, -1)
    picks = torch.rand(B, S, T, generator=g).argsort(-1)[..., :K]
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[1, S * 3 // 4:] = False
    return dict(q=randn(B, S, H, D).transpose(1, 2), kv=randn(B, S, D),
                comp=None if mode == "sliding" else randn(B, T, D),
                topk=torch.where(picks >= thr[..., None], -1, picks) if mode == "csa" else None,
                thr=thr if mode == "hca" else None, valid=valid, sinks=randn(H),
                grad=randn(B, S, H, D).transpose(1, 2), scale=D ** -0.5, window=window)


def run(impl: str, case: dict, dtype: torch.dtype, device="cpu") -> list:
    """[out, dq, dkv, dcomp, dsinks] of `impl` (see IMPLS) on `case` in `dtype` (sinks stay
    fp32, as a checkpoint keeps them); dcomp is None on sliding layers."""
    from rl.models.v4_attention import kernel
    kernel.FORCE, kernel.BACKWARD = IMPLS[impl]

    def leaf(name, cast=True):
        t = case[name]
        if t is None:
            return None
        return t.to(device, dtype if cast else t.dtype, copy=True).requires_grad_()
    q, kv, comp, sinks = leaf("q"), leaf("kv"), leaf("comp"), leaf("sinks", cast=False)
    ints = {k: None if case[k] is None else case[k].to(device) for k in ("topk", "thr", "valid")}
    out = kernel.attention(q, kv, comp, ints["topk"], ints["thr"], ints["valid"], sinks,
                           case["scale"], case["window"])
    out.backward(case["grad"].to(device, dtype))
    return [out.detach(), q.grad, kv.grad, None if comp is None else comp.grad, sinks.grad]


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error in the Frobenius norm, in fp32."""
    return ((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30)).item()


def compare(case: dict, dtype: torch.dtype, device="cpu", impls=("triton", "triton_torch_bwd")
            ) -> dict:
    """{impl: {name: relative error}} of each impl in `dtype` against the chunked path in fp32
    (the truth), and under "chunked" the chunked path's own error in `dtype`."""
    truth = run("chunked", case, torch.float32, device)
    errors = {}
    for impl in (("chunked",) if dtype != torch.float32 else ()) + tuple(impls):
        got = run(impl, case, dtype, device)
        for name, g, w in zip(NAMES, got, truth):
            assert (g is None) == (w is None), (impl, name)
        errors[impl] = {n: rel(g, w) for n, g, w in zip(NAMES, got, truth) if w is not None}
    return errors

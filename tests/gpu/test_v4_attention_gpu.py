"""rl.models.v4_attention at V4-Flash's real attention dims (64 heads x 512, one K=V head,
window 128, CSA top-512 of rate-4 entries, HCA rate 128) on a GPU, in BF16, against
transformers' eager attention: outputs and every gradient of one layer's forward + backward,
with the two-pass Triton backward (the default), the one-pass one and the torch recompute one;
and the attention op alone, the backwards against the chunked path in fp32, per layer kind, in
BF16 and fp32."""
import pytest
import torch

from bench.v4_attention import build_layer, run_layer, v4_config
from tests.rl.models.v4_attention_cases import compare, make_case

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
    for impl in ("eager", "triton", "triton_one_pass", "triton_torch_bwd", "torch"):
        attn.zero_grad()
        x = hidden.clone().requires_grad_()
        out = run_layer(attn, rotary, x, impl)
        out.backward(grad)
        grads = {n: p.grad.clone() for n, p in attn.named_parameters() if p.grad is not None}
        results[impl] = (out.detach(), x.grad, grads)
    want_out, want_dx, want_grads = results["eager"]
    assert "sinks" in want_grads and "compressor.kv_proj.weight" in want_grads
    for impl in ("triton", "triton_one_pass", "triton_torch_bwd", "torch"):
        out, dx, grads = results[impl]
        assert grads.keys() == want_grads.keys()
        errors = {"output": _rel(out, want_out), "d_hidden": _rel(dx, want_dx)}
        errors.update({f"d_{n}": _rel(grads[n], want_grads[n]) for n in want_grads})
        worst = max(errors, key=errors.get)
        report(f"v4_attention_{layer}_{impl}", worst=worst, **{k: round(v, 5) for k, v in
                                                              errors.items()})
        # bf16: eager rounds its scores and probabilities to bf16; ours keeps them in fp32
        assert errors[worst] < 2e-2, (impl, worst, errors[worst])


def _bwd_case(mode: str, dtype: str) -> dict:
    # bf16: V4-Flash's head (64 x 512, window 128) over 6 key tiles of CSA picks; fp32 at
    # head_dim 128 (fp32 tiles of 512 need more shared memory), 12 heads padded to 16.
    if dtype == "bfloat16":
        dims = dict(B=2, H=64, S=768, D=512, K=64, window=128)
    else:
        dims = dict(B=2, H=12, S=512, D=128, K=48, window=128)
    return make_case(mode, rate=16 if mode == "hca" else 4, **dims)


def _tiles_key(case: dict, dtype: str) -> tuple:
    # the backward kernels' tiles key: (head_dim, padded heads, dtype)
    _, H, _, D = case["q"].shape
    return D, max(16, 1 << (H - 1).bit_length()), getattr(torch, dtype)


@pytest.mark.parametrize("mode", ["csa", "hca", "sliding"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_pass_backward_matches_chunked(mode, dtype, report):
    from rl.models.v4_attention import triton_bwd
    case = _bwd_case(mode, dtype)
    errors = compare(case, getattr(torch, dtype), "cuda", impls=("triton_one_pass",
                                                                 "triton_torch_bwd"))
    for impl, errs in errors.items():
        report(f"v4_attention_bwd_{mode}_{dtype}_{impl}", **{k: round(v, 6) for k, v in
                                                             errs.items()})
    # the one-pass backward ran (no fallback) with the tiles it timed
    assert _tiles_key(case, dtype) in triton_bwd.TUNED
    # against the fp32 truth: bf16 a few roundings (the torch paths ~4e-3); the Triton kernels'
    # fp32 dots run in TF32 (forward and backward alike)
    bound = 2e-2 if dtype == "bfloat16" else 1e-2
    for impl, errs in errors.items():  # all(): max() would pass over a NaN
        assert all(e < bound for e in errs.values()), (impl, errs)


@pytest.mark.parametrize("mode", ["csa", "hca", "sliding"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_two_pass_backward_matches_chunked(mode, dtype, report, monkeypatch):
    """`triton_bwd2` (the default) beside `triton_bwd`, both against the chunked path in fp32,
    on the cases above; buffers of 500 tokens (bf16) or 1,000 (fp32): the 1,536 or 1,024 tokens
    in chunks, the last partial."""
    from rl.models.v4_attention import triton_bwd2
    case = _bwd_case(mode, dtype)
    key = _tiles_key(case, dtype)
    columns = 128 + (64 if mode != "sliding" else 0)  # window, picks or (HCA) entries
    monkeypatch.setattr(triton_bwd2, "CHUNK_BYTES", (500 if dtype == "bfloat16" else 1000)
                        * 2 * key[1] * columns * key[2].itemsize)
    errors = compare(case, key[2], "cuda", impls=("triton", "triton_one_pass"))
    for impl, errs in errors.items():
        report(f"v4_attention_bwd2_{mode}_{dtype}_{impl}", **{k: round(v, 6) for k, v in
                                                              errs.items()})
    # both passes ran (no fallback) with the tiles they timed
    assert key in triton_bwd2.SCORES.tuned and key in triton_bwd2.GRADS.tuned
    report(f"v4_attention_bwd2_tiles_{mode}_{dtype}", scores=triton_bwd2.SCORES.tuned[key],
           grads=triton_bwd2.GRADS.tuned[key])
    bound = 2e-2 if dtype == "bfloat16" else 1e-2
    for impl, errs in errors.items():
        assert all(e < bound for e in errs.values()), (impl, errs)
    # the same roundings as the one-pass backward, summed in another order
    for name, err in errors["triton"].items():
        assert err < 1.2 * errors["triton_one_pass"][name] + 1e-4, (name, errors)


def test_triton_indexer_matches_torch_at_flash_dims(report):
    """The CSA indexer's Triton scores (`triton_indexer`, the GPU default) against the torch
    per-head scores: the scores on random BF16 inputs of Flash's indexer dims, and the top-512
    picks of a Flash CSA layer's indexer over 8,192 tokens."""
    from rl.models.v4_attention import compress, kernel
    from rl.models.v4_attention.triton_indexer import index_scores
    kernel.FORCE = ""  # by device: Triton on CUDA (run_layer may have left another choice)
    g = torch.Generator(device="cuda").manual_seed(0)
    S, H, D, T = 1024, 64, 128, 2048
    q = torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(1, S, H, device="cuda", generator=g) * 0.1
    thr = ((torch.arange(S, device="cuda") * 2 + 1)).unsqueeze(0)  # rows see 1 .. 2,047
    got = index_scores(q, k, w, thr)
    want = torch.relu(torch.einsum("bshd,btd->bsht", q.float(), k.float()))
    want = (want * w.unsqueeze(-1)).sum(2).masked_fill(
        torch.arange(T, device="cuda") >= thr.unsqueeze(-1), float("-inf"))
    assert torch.equal(got.isinf(), want.isinf())
    seen = ~want.isinf()
    err = ((got[seen] - want[seen]).abs().max() / want[seen].abs().max()).item()
    attn, _ = build_layer(v4_config(), "csa", "cuda")
    indexer = attn.compressor.indexer
    hidden = torch.randn(1, 8192, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    residual = torch.randn(1, 8192, indexer.q_b_proj.in_features, device="cuda",
                           dtype=torch.bfloat16, generator=g)
    pos = torch.arange(8192, device="cuda").unsqueeze(0)
    picks = {}
    for mode in ("torch", ""):
        compress.INDEXER = mode
        picks[mode or "triton"] = compress.indexer_topk(indexer, hidden, residual, pos)
    compress.INDEXER = ""
    a, b = picks["torch"], picks["triton"]
    assert torch.equal((a < 0).sum(-1), (b < 0).sum(-1))
    T = int(a.max()) + 2

    def chosen(p):
        m = torch.zeros(p.shape[1], T, dtype=torch.bool, device="cuda")
        return m.scatter_(1, torch.where(p[0] < 0, T - 1, p[0]), True)[:, :T - 1]
    ma, mb = chosen(a), chosen(b)
    overlap = ((ma & mb).sum() / ma.sum()).item()
    report("v4_indexer_triton", score_rel_err=err, picks_overlap=overlap)
    assert err < 1e-5, err
    # the same picks but where two scores tie to fp32 rounding at the 512th place
    assert overlap > 0.999, overlap

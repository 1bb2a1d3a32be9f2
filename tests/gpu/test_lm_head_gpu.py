"""The chunked LM head (`rl.trainer.lm_head`) on a GPU in BF16 at V4-Flash's head width (hidden
4,096, a 32,768-entry slice of its vocabulary), 4,096 tokens, several vocabulary slices in
backward (the fp32-output bf16 GEMM accumulating the hidden states' gradient): log-probs equal
the full-logits path's, and the log-probs, entropies and both gradients are no further from an
fp32 computation than the full-logits path is."""
import pytest
import torch

from rl.trainer import lm_head, losses
from rl.trainer.lm_head import chunked_logprobs

pytestmark = pytest.mark.gpu


def _run(path, h, w, targets, weights, chunk_rows=256):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    if path == "chunked":
        logp, ent = chunked_logprobs(h, w, targets, 1.0, chunk_rows, entropy=True)
    else:
        logits = h @ w.t()
        logp = losses.token_logprobs(logits, targets)
        with torch.no_grad():
            ent = losses.entropy_from_logits(logits.detach())
    (logp * weights).sum().backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def test_chunked_head_on_cuda_matches_full_logits(report):
    g = torch.Generator(device="cuda").manual_seed(0)
    T, H, V = 4096, 4096, 32768
    h = torch.randn(1, T, H, device="cuda", generator=g).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=g) * H ** -0.5 * 4).bfloat16()
    targets = torch.randint(0, V, (1, T), device="cuda", generator=g)
    weights = torch.randn(1, T, device="cuda", generator=g)
    got = _run("chunked", h, w, targets, weights)  # 256 x 32768 / 4096 = 2048-column slices
    ref = _run("full", h, w, targets, weights)
    truth = _run("full", h.float(), w.float(), targets, weights)
    assert lm_head._fp32_out_mm  # torch.mm(out_dtype=float32) ran, not the widened fallback
    errors = {}
    for name, a, b, t in zip(("logp", "entropy", "grad_h", "grad_w"), got, ref, truth):
        scale = t.float().norm()
        errors[name] = ((a.float() - t).norm() / scale).item()
        errors[name + "_full_path"] = ((b.float() - t).norm() / scale).item()
        assert errors[name] <= 1.1 * errors[name + "_full_path"] + 1e-6, name
    report("lm_head_chunked_vs_full", **{k: round(v, 6) for k, v in errors.items()})
    # the chunk GEMM and the full one may round a logit differently (one bf16 step at |l| ~ 8)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0.07)

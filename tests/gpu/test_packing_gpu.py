"""Packed rows on a GPU in BF16 (`trainer.pack_sequences`): torch's FlashAttention varlen kernel
(`rl.models.varlen`, the path the trainer takes there) against SDPA row by row, with grouped
heads, values and gradients; and a random Qwen3 and the tiny DeepSeek-V4 (the trainer's attention
installed) whose packed log-probs and gradients in BF16 are no further from the fp32 padded path
than the BF16 padded path is, while the same rows packed with their bounds withheld are
not."""
import pytest
import torch

from rl.models import varlen

pytestmark = pytest.mark.gpu


def test_varlen_kernel_matches_sdpa_row_by_row():
    assert varlen._varlen_kernel() is not None, "torch.nn.attention.varlen.varlen_attn missing"
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [700, 3, 129, 1500, 64]
    T, H, Hkv, D = sum(lengths), 16, 8, 128
    q, k, v = (torch.randn(1, h, T, D, device="cuda", generator=g, dtype=torch.bfloat16)
               .requires_grad_() for h in (H, Hkv, Hkv))
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).int()
    grad = torch.randn(1, T, H, D, device="cuda", generator=g, dtype=torch.bfloat16)
    out = varlen.packed_attention(q, k, v, cu, max(lengths), D ** -0.5)
    out.backward(grad)
    got = [out.detach()] + [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    outs = [torch.nn.functional.scaled_dot_product_attention(
        q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, enable_gqa=True)
        for a, b in varlen.row_bounds(cu)]
    ref = torch.cat(outs, dim=2).transpose(1, 2)
    ref.backward(grad)
    want = [ref.detach()] + [t.grad for t in (q, k, v)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 0.02 * b.float().abs().max().item() + 1e-3, (name, err)


def _logprobs_and_grads(model, mb, packed: bool, bounds: bool = True, device: str = "cuda"):
    from rl.trainer import losses
    from rl.trainer.packing import model_inputs, unpack
    model.zero_grad(set_to_none=True)
    kwargs, targets, layout = model_inputs(mb.input_ids, mb.attention_mask, packed, device)
    if not bounds:  # the negative control: one sequence, attention across the rows' ends
        kwargs = {k: v for k, v in kwargs.items() if not k.startswith(("cu_seq", "max_len"))}
    logp = losses.token_logprobs(model(**kwargs).logits[:, :-1], targets)
    if layout is not None:
        logp = unpack(logp, layout)
    logp = logp * mb.resp_mask[:, 1:].to(device)
    logp.sum().backward()
    return logp.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters()
                                   if p.grad is not None}


def _errors(result, truth) -> tuple[float, float]:
    """(the log-probs' largest error, the parameters' mean relative gradient error)."""
    (logp, grads), (true, true_g) = result, truth
    assert grads.keys() == true_g.keys()
    rel = [((g - true_g[n]).norm() / true_g[n].norm().clamp_min(1e-12)).item()
           for n, g in grads.items()]
    return (logp - true).abs().max().item(), sum(rel) / len(rel)


def _assert_packed_as_close_as_padded(build, mb, device: str = "cuda"):
    """BF16 packed vs BF16 padded, both against the fp32 padded path: the packed one is no
    further from fp32 than the padded one, in its log-probs (largest error) and its gradients
    (the mean over parameters of each one's relative error: one parameter's is BF16 noise, up
    to 60% on the tiny models' hyper-connection scalars for both paths alike, and TF32 / Triton
    make the fp32 reference itself a percent off the CPU's). The same run with the rows' bounds
    withheld (attention across rows) must miss the bound: the check sees the bug it guards."""
    from rl.trainer.packing import install
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = build(dtype).train()
        install(model)
        results[dtype, False] = _logprobs_and_grads(model, mb, packed=False, device=device)
        if dtype == torch.bfloat16:
            results["packed"] = _logprobs_and_grads(model, mb, packed=True, device=device)
            results["no bounds"] = _logprobs_and_grads(model, mb, packed=True, bounds=False,
                                                       device=device)
        del model
    truth = results[torch.float32, False]
    ref_lp, ref_g = _errors(results[torch.bfloat16, False], truth)
    got_lp, got_g = _errors(results["packed"], truth)
    bad_lp, bad_g = _errors(results["no bounds"], truth)
    lp_bound, g_bound = 1.25 * ref_lp + 0.01, 1.25 * ref_g + 0.02
    print(f"log-prob error: padded {ref_lp:.4f} packed {got_lp:.4f} unbounded {bad_lp:.4f}; "
          f"mean gradient error: padded {ref_g:.4f} packed {got_g:.4f} unbounded {bad_g:.4f}")
    assert got_lp <= lp_bound and got_g <= g_bound, (got_lp, lp_bound, got_g, g_bound)
    assert bad_lp > lp_bound and bad_g > g_bound, (bad_lp, lp_bound, bad_g, g_bound)


def _batch(lengths, vocab_hi: int):
    from rl.trainer.microbatch import pad_batch
    g = torch.Generator().manual_seed(0)
    return pad_batch([[1] + torch.randint(3, vocab_hi, (p,), generator=g).tolist()
                      for p, _ in lengths],
                     [torch.randint(3, vocab_hi, (r,), generator=g).tolist() for _, r in lengths])


def test_packed_qwen3_matches_padded_on_cuda():
    from bench.common import QWEN3_06B, random_model
    fields = {**QWEN3_06B, "num_hidden_layers": 4}
    _assert_packed_as_close_as_padded(lambda dtype: random_model("qwen3", fields, "cuda", dtype),
                                      _batch([(64, 900), (200, 5), (80, 300), (120, 40)], 1000))


def test_packed_v4_matches_padded_on_cuda(tmp_path_factory):
    """The tiny DeepSeek-V4 as the trainer loads it for a GPU (Triton V4 attention, the fused
    layer): packed rows run the attention row by row. Rows of 3-300 tokens span CSA windows
    (and rows too short for one), top-k picks, HCA windows of 128 and the sliding window."""
    from rl.config import ModelConfig
    from rl.models.loading import load_model, resolve_model_dir
    d = resolve_model_dir(ModelConfig(preset="tiny-deepseek-v4"),
                          tmp_path_factory.mktemp("models"))
    _assert_packed_as_close_as_padded(lambda dtype: load_model(d, dtype, device="cuda"),
                                      _batch([(20, 280), (1, 1), (30, 10), (2, 1), (100, 40),
                                              (1, 4), (8, 200)], 100))

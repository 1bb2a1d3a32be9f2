"""Packed rows on a GPU in BF16 (`trainer.pack_sequences`): torch's FlashAttention varlen kernel
(`rl.models.varlen`, the path the trainer takes there) against SDPA row by row, with grouped
heads, values and gradients; and a random Qwen3 (the trainer's attention installed) whose packed
log-probs and gradients equal the padded path's within bf16 rounding."""
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


def test_packed_qwen3_matches_padded_on_cuda():
    from bench.common import QWEN3_06B, random_model
    from rl.trainer import losses
    from rl.trainer.microbatch import pad_batch
    from rl.trainer.packing import install, model_inputs, unpack
    fields = {**QWEN3_06B, "num_hidden_layers": 4}
    model = random_model("qwen3", fields, "cuda", torch.bfloat16).train()
    install(model)
    g = torch.Generator().manual_seed(0)
    lengths = [(64, 900), (200, 5), (80, 300), (120, 40)]
    mb = pad_batch([torch.randint(3, 1000, (p,), generator=g).tolist() for p, _ in lengths],
                   [torch.randint(3, 1000, (r,), generator=g).tolist() for _, r in lengths])
    results = []
    for packed in (False, True):
        model.zero_grad(set_to_none=True)
        kwargs, targets, layout = model_inputs(mb.input_ids, mb.attention_mask, packed, "cuda")
        logp = losses.token_logprobs(model(**kwargs).logits[:, :-1], targets)
        if layout is not None:
            logp = unpack(logp, layout)
        logp = logp * mb.resp_mask[:, 1:].cuda()
        logp.sum().backward()
        results.append((logp.detach().float(),
                        {n: p.grad.float().clone() for n, p in model.named_parameters()}))
    (ref, ref_grads), (got, grads) = results
    assert (got - ref).abs().max().item() <= 0.05
    for name, gr in grads.items():
        scale = ref_grads[name].abs().max().item()
        assert (gr - ref_grads[name]).abs().max().item() <= 0.1 * scale + 1e-6, name

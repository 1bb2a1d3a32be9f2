"""The chunked LM head (`rl.trainer.lm_head`) against the full-logits path it replaces
(`losses.token_logprobs` / `losses.entropy_from_logits` on `hidden @ W^T`): values and gradients
for the hidden states and the weight, fp32 tightly and bf16 within bf16 rounding (against an fp64
truth, no further from it than the full-logits path), with temperature, padding masks, the
entropy as a loss term or only a metric, tied embeddings and the real tiny models; then memory:
no op of the chunked path, forward or backward, makes a tensor of more than one chunk of logits,
and its peak stays within what `rl.plan.activations` books."""
import copy
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rl.models.presets import preset_config
from rl.plan.activations import chunked_head_bytes
from rl.trainer import losses
from rl.trainer.lm_head import LogprobHead, chunked_logprobs


def _full(hidden, weight, targets, temperature, entropy_grad):
    """The full-logits path as the trainer ran it: bf16 logits, fp32 chunks, per-token outputs."""
    logits = hidden @ weight.t()
    logp = losses.token_logprobs(logits, targets, temperature)
    if entropy_grad:
        ent = losses.entropy_from_logits(logits.float() / temperature)
    else:
        with torch.no_grad():
            ent = losses.entropy_from_logits(logits.detach().float() / temperature)
    return logp, ent


def _case(dtype, B=3, T=9, H=16, V=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.6).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[0, 6:] = 0  # right padding
    mask[1, :2] = 0  # prompt positions
    targets[0, 6:] = 0  # PAD_ID, as pad_batch writes it
    adv = torch.randn(B, generator=g)
    return hidden, weight, targets, mask, adv


def _loss(logp, ent, mask, adv, entropy_grad):
    """A policy-gradient-shaped loss: masked token mean of -A logp (+ an entropy bonus)."""
    loss = losses.masked_aggregate(-adv[:, None] * logp, mask, "token")
    if entropy_grad:
        loss = loss - 0.1 * losses.masked_aggregate(ent, mask, "token")
    return loss


def _run(path, hidden, weight, targets, mask, adv, temperature, entropy_grad, chunk_rows=4):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    if path == "chunked":
        logp, ent = chunked_logprobs(h, w, targets, temperature, chunk_rows, entropy=True)
        if not entropy_grad:
            ent = ent.detach()
    else:
        logp, ent = _full(h, w, targets, temperature, entropy_grad)
    _loss(logp, ent, mask, adv, entropy_grad).backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("chunk_rows", [1, 4, 1000])
def test_fp32_equals_the_full_logits_path(temperature, entropy_grad, chunk_rows):
    case = _case(torch.float32)
    got = _run("chunked", *case, temperature, entropy_grad, chunk_rows)
    ref = _run("full", *case, temperature, entropy_grad)
    for name, a, b in zip(("logp", "entropy", "grad hidden", "grad weight"), got, ref):
        assert a.dtype == b.dtype, name
        # the entropy is logsumexp - E[l], a difference of numbers ~20 here: fp32 rounding of
        # those, ~1e-5, whichever way it is summed
        atol = 3e-5 if name == "entropy" else 2e-6
        torch.testing.assert_close(a, b, rtol=1e-5, atol=atol, msg=name)
    # masked positions get no gradient, and the weight's gradient is not trivially zero
    assert got[2][0, 6:].abs().max() == 0 and got[3].abs().max() > 1e-3


def _errors(got, ref, truth):
    """Max |x - truth| / max |truth| of each output, for ours and the full-logits path."""
    out = {}
    for name, a, b, t in zip(("logp", "entropy", "grad hidden", "grad weight"), got, ref, truth):
        assert a.dtype == b.dtype, name  # bf16 gradients like the parameters, fp32 log-probs
        scale = t.abs().max().item()
        out[name] = tuple((x.double() - t).abs().max().item() / scale for x in (a, b))
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_bf16_within_bf16_rounding(temperature, entropy_grad):
    hidden, weight, targets, mask, adv = _case(torch.bfloat16, B=2, T=40, H=64, V=96)
    got = _run("chunked", hidden, weight, targets, mask, adv, temperature, entropy_grad, 8)
    ref = _run("full", hidden, weight, targets, mask, adv, temperature, entropy_grad)
    truth = _run("full", hidden.double(), weight.double(), targets, mask, adv, temperature,
                 entropy_grad)
    # both paths round the logits to bf16 (~1% of their scale here): no further from the fp64
    # truth than the full-logits path
    for name, (err, ref_err) in _errors(got, ref, truth).items():
        assert err < 0.03 and err <= 1.1 * ref_err + 1e-6, (name, err, ref_err)
    # the same bf16 logits: log-probs agree to fp32 rounding
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-5)


def test_many_vocabulary_slices_in_bf16_accumulate_in_fp32():
    # 512 rows, chunk_rows 8: the backward takes the vocabulary in 8 x 96 / 512 = 1-column
    # slices. Summed in fp32 and rounded once, the hidden states' gradient is the full path's
    # but for the odd last-bit tie; rounding each slice's product to bf16 before summing made
    # 27% of the entries differ (mean relative difference 1.5e-3, measured)
    hidden, weight, targets, mask, adv = _case(torch.bfloat16, B=4, T=128, H=32, V=96)
    got = _run("chunked", hidden, weight, targets, mask, adv, 1.0, False, 8)
    ref = _run("full", hidden, weight, targets, mask, adv, 1.0, False)
    for a, b in zip(got[2:], ref[2:]):
        diff = (a.double() - b.double()).abs()
        assert diff.mean() / b.double().abs().mean() < 1e-4
        assert (diff > 0).double().mean() < 0.01


def test_bad_arguments_are_refused():
    h, w, t = torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="do not match"):
        chunked_logprobs(h, w, t[:, :2])
    with pytest.raises(ValueError, match="temperature"):
        chunked_logprobs(h, w, t, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_rows"):
        chunked_logprobs(h, w, t, chunk_rows=0)
    model = torch.nn.Module()
    model.get_output_embeddings = lambda: torch.nn.Linear(4, 5)  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="with a bias.*trainer.chunked_lm_head: false"):
        LogprobHead.install(model)


def _tiny(preset, dtype, tie=False):
    from transformers import AutoModelForCausalLM
    config = preset_config(preset, 128)
    config.tie_word_embeddings = tie
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if preset == "tiny-deepseek-v4":
        from rl.models import v4_attention, v4_precision
        v4_precision.install(model)
        v4_attention.install(model)
        for module in model.modules():  # hash routing reads tid2eid, zeros at init
            if hasattr(module, "tid2eid"):
                module.tid2eid.copy_(torch.randint(0, 8, module.tid2eid.shape))
    return model.train()


def _model_step(model, ids, attn, chunked):
    """Log-probs, entropies and every parameter's gradient, through the model's own forward."""
    model.zero_grad(set_to_none=True)
    targets = ids[:, 1:]
    if chunked:
        head = LogprobHead.install(model)
        with head.logprobs_of(targets, entropy=True, chunk_rows=5):
            pairs = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
        logp, ent = pairs[..., 0], pairs[..., 1]
    else:
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1]
        logp, ent = losses.token_logprobs(logits, targets), losses.entropy_from_logits(logits)
    mask = attn[:, 1:].float()
    adv = torch.tensor([1.0, -0.5])
    _loss(logp, ent, mask, adv, True).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), ent.detach(), grads


@pytest.mark.slow
@pytest.mark.parametrize("preset, dtype, tie", [
    ("tiny-qwen3-moe", torch.float32, False), ("tiny-qwen3-moe", torch.float32, True),
    ("tiny-deepseek-v4", torch.float32, False), ("tiny-qwen3-moe", torch.bfloat16, True),
    ("tiny-deepseek-v4", torch.bfloat16, False)])
def test_the_models_forward_through_the_head(preset, dtype, tie):
    """The model's body (final norm, V4's hyper-connection collapse) then the chunked head gives
    the full path's log-probs and every parameter's gradient; a tied head stays tied."""
    model = _tiny(preset, dtype, tie)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 12), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 9:] = 0
    ref = _model_step(model, ids, attn, chunked=False)
    got = _model_step(model, ids, attn, chunked=True)
    head = model.get_output_embeddings()
    assert isinstance(head, LogprobHead)
    if tie:
        assert head.weight is model.get_input_embeddings().weight
    names = [n for n, _ in model.named_parameters()]
    assert ("lm_head.weight" in names) != tie  # state-dict names are unchanged
    assert set(got[2]) == set(ref[2]) and len(got[2]) > 10
    if dtype == torch.float32:
        torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-5)
        for name, g_ref in ref[2].items():
            rel = (got[2][name] - g_ref).abs().max() / g_ref.abs().max().clamp(min=1e-6)
            assert rel < 1e-3, (name, rel)
    else:
        # same bf16 body and logits: the same log-probs; gradients against the same weights
        # in fp32, no further off than the full path (bf16 routing flips make both ~5% off
        # for V4, measured)
        torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(got[1], ref[1], rtol=0, atol=1e-4)
        truth = _model_step(copy.deepcopy(model).float(), ids, attn, chunked=False)[2]
        sq = {k: sum(((x[n].float() - t) ** 2).sum().item() for n, t in truth.items())
              for k, x in (("got", got[2]), ("ref", ref[2]))}
        norm = sum((t ** 2).sum().item() for t in truth.values())
        err, ref_err = (sq["got"] / norm) ** 0.5, (sq["ref"] / norm) ** 0.5
        assert err <= 1.1 * ref_err + 1e-3, (err, ref_err)
    assert all(got[2][n].dtype == g.dtype for n, g in ref[2].items())
    assert got[2]["model.embed_tokens.weight"].dtype == dtype
    # outside the context the head is nn.Linear: generation and plain forwards see logits
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    assert logits.shape == (2, 12, 128)


class _Allocations(TorchDispatchMode):
    """Every tensor the ops make while active: the largest one, and the peak of live bytes
    (storages counted once, released when their last tensor dies)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.largest = 0
        self.refs: dict[int, int] = {}

    def _release(self, key, nbytes):
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves(
            (args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if key not in self.refs:
                if key in inputs:  # a view or in-place result of a tensor made outside
                    continue
                self.refs[key] = 0
                self.live += nbytes
                self.largest = max(self.largest, nbytes)
                self.peak = max(self.peak, self.live)
            self.refs[key] += 1  # views keep the storage alive too
            weakref.finalize(t, self._release, key, nbytes)
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_tensor_holds_more_than_one_chunk_of_logits(dtype):
    B, T, H, V, rows = 1, 256, 32, 4096, 16
    hidden = torch.randn(B, T, H).to(dtype).requires_grad_()
    weight = (torch.randn(V, H) * 0.1).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (B, T))
    grad_logp, grad_ent = torch.randn(B, T), torch.randn(B, T)
    saved = []
    chunk_bytes = rows * V * 4  # one chunk of fp32 logits

    def paths():
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t,
                                                      lambda t: t):
            logp, ent = chunked_logprobs(hidden, weight, targets, 1.0, rows, entropy=True)
        torch.autograd.backward([logp, ent], [grad_logp, grad_ent])

    with _Allocations() as chunked:
        paths()
    assert chunked.largest <= max(chunk_bytes, weight.numel() * weight.element_size())
    # saved for backward: the hidden states, the weight (references) and per-row numbers
    assert sorted(saved)[-2:] == sorted([T * H, V * H]) and sorted(saved)[-3] <= T
    # what rl.plan.activations books for it covers the measured peak (gradients included)
    grads = (T * H + V * H) * hidden.element_size()
    booked = chunked_head_bytes(T, H, V, rows, hidden.element_size()) + grads
    assert chunked.peak <= booked, (chunked.peak, booked)

    hidden.grad = weight.grad = None
    with _Allocations() as full:  # the old path: the whole (T, V) logits and their gradient
        logits = hidden @ weight.t()
        logp = losses.token_logprobs(logits, targets, chunk_rows=rows)
        ent = losses.entropy_from_logits(logits, chunk_rows=rows)
        torch.autograd.backward([logp, ent], [grad_logp, grad_ent])
    assert full.largest >= T * V * hidden.element_size()
    assert full.peak > 4 * chunked.peak


def test_backward_slices_on_cuda_keep_tensor_core_alignment():
    """`slice_columns`: a forward chunk's worth of logits per backward slice; with CUDA's
    alignment a multiple of 128 columns (V4-Flash at 18,432 tokens: 7,182 -> 7,168)."""
    from rl.trainer.lm_head import SLICE_ALIGN, slice_columns
    assert slice_columns(18432, 129280, 1024) == 7182  # the CPU rule: exactly a chunk's logits
    assert slice_columns(18432, 129280, 1024, SLICE_ALIGN) == 7168
    assert slice_columns(8192, 129280, 1024, SLICE_ALIGN) == 16128
    assert slice_columns(18432, 129280, 512, SLICE_ALIGN) == 3584
    assert slice_columns(512, 96, 8) == 1 and slice_columns(512, 96, 8, SLICE_ALIGN) == 96
    assert slice_columns(4, 129280, 1024, SLICE_ALIGN) == 129280  # one slice: nn.Linear's GEMM
    for rows in (1, 777, 18432, 10 ** 6, 10 ** 7):
        cols = slice_columns(rows, 129280, 1024, SLICE_ALIGN)
        assert cols % SLICE_ALIGN == 0 or cols == 129280
        assert cols * rows <= 1024 * 129280 or cols == SLICE_ALIGN

"""rl.models.v4_layer (the fused hyper-connections, norms and MoE that `load_model` installs with
`RL_V4_LAYER=1`) against transformers' layer with its eager experts loop, on CPU: values and every
gradient (router weights included) in fp32 and bf16, for tiny-deepseek-v4 and a V4-Flash-shaped
small model (4 streams, 20 Sinkhorn iterations, top-6 of 16 experts, a hash-routed layer)."""
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4DecoderLayer, DeepseekV4Experts, DeepseekV4ForCausalLM)

from rl.models import v4_layer
from rl.models.hf_classes import transformers_classes
from rl.models.loading import load_model
from rl.models.v4_layer import compiled, hyper, modules, moe
from rl.models.v4_layer.moe import IMPLEMENTATION, experts_forward

# V4-Flash's mixer and router settings (hc_mult 4, 20 Sinkhorn iterations, sqrt-softplus scores
# scaled 1.5, top-6) at small widths; swiglu_limit and the init scale chosen so the clamps bite.
FLASH_SMALL = dict(
    vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=1, head_dim=32, q_lora_rank=32, qk_rope_head_dim=8,
    moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=6, n_shared_experts=1,
    o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=3,
    layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    mlp_layer_types=["hash_moe", "moe"], sliding_window=8, hc_mult=4, hc_sinkhorn_iters=20,
    scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=1.0,
    initializer_range=0.1, max_position_embeddings=256)


def _flash_small_dir(path):
    config_cls, _ = transformers_classes("deepseek_v4")
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(config_cls(**FLASH_SMALL)).float()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("tid2eid"):  # each token its own 6 distinct experts
                t.copy_(torch.stack([torch.randperm(16, generator=g)[:6]
                                     for _ in range(t.shape[0])]))
            elif name.endswith(("base", "hc_base", "sinks", "position_bias")):
                t.normal_(0, 0.5, generator=g)  # init leaves them 0
            elif name.endswith("e_score_correction_bias"):
                t.normal_(0, 0.1, generator=g)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dirs(preset_dirs, tmp_path_factory):
    return {"tiny-deepseek-v4": preset_dirs["tiny-deepseek-v4"],
            "flash-small": _flash_small_dir(tmp_path_factory.mktemp("flash_small"))}


def _pair(model_dir, dtype):
    """(fused: as load_model gives it, reference: transformers' layer and eager experts)."""
    fused = load_model(model_dir, dtype).train()
    if not isinstance(fused.model.layers[0], modules.FusedDecoderLayer):
        v4_layer.install(fused)  # what load_model does with RL_V4_LAYER=1
    ref = copy.deepcopy(fused)
    v4_layer.restore(ref, experts="eager")
    return fused, ref


def _run(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.logits.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()
                                         if p.grad is not None}


def _rel(got, want):
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


def _ids(model, seq=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (2, seq), generator=g)


@pytest.mark.parametrize("name", ["tiny-deepseek-v4", "flash-small"])
def test_fp32_matches_transformers(model_dirs, name):
    fused, ref = _pair(model_dirs[name], torch.float32)
    assert isinstance(fused.model.layers[0], modules.FusedDecoderLayer)
    assert type(ref.model.layers[0]) is DeepseekV4DecoderLayer
    assert fused.model.layers[0].mlp.is_hash and not fused.model.layers[1].mlp.is_hash
    ids = _ids(fused)
    want_logits, want = _run(ref, ids)
    logits, got = _run(fused, ids)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert got.keys() == want.keys()
    errors = {n: _rel(got[n], want[n]) for n in want}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-4, (worst, errors[worst])
    # what the MoE and mixers train: routers (hash and learned), experts, shared expert, mixers
    for part in ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                 "mlp.shared_experts.up_proj.weight", "attn_hc.fn", "attn_hc.scale",
                 "ffn_hc.base"):
        for layer in (0, 1):
            assert want[f"model.layers.{layer}.{part}"].abs().max() > 0, (layer, part)
    assert want["model.hc_head.hc_fn"].abs().max() > 0


@pytest.mark.parametrize("name", ["tiny-deepseek-v4", "flash-small"])
def test_bf16_matches_transformers(model_dirs, name):
    """BF16, the production dtype, against the same (bf16-rounded) weights computed in fp32:
    the fused layer is as close as transformers' (its stream mix rounds once, transformers' at
    each step).
    Per parameter within 2x transformers' error plus bf16 noise: sums over tokens such as the
    mixers' `base` gradients cancel to ~1e-5 of the gradient norm, where either path's bf16
    rounding can flip their sign."""
    fused, ref = _pair(model_dirs[name], torch.bfloat16)
    exact = copy.deepcopy(fused).float()
    ids = _ids(fused, seed=1)
    want_logits, want = _run(exact, ids)
    results = {"fused": _run(fused, ids), "transformers": _run(ref, ids)}
    err = {k: _rel(logits, want_logits) for k, (logits, _) in results.items()}
    assert err["fused"] < 5e-2 and err["fused"] <= 1.25 * err["transformers"], err
    ours, theirs = results["fused"][1], results["transformers"][1]
    assert ours.keys() == theirs.keys() == want.keys()
    norm = torch.cat([g.flatten() for g in want.values()]).norm()

    def dist(grads, n):
        return (grads[n] - want[n]).norm()
    total = {k: sum(dist(g, n) ** 2 for n in want).sqrt() / norm
             for k, g in (("fused", ours), ("transformers", theirs))}
    assert total["fused"] < 0.1 and total["fused"] <= 1.25 * total["transformers"], total
    for n in want:
        assert dist(ours, n) <= 2 * dist(theirs, n) + 0.1 * want[n].norm() + 1e-4 * norm, n


def _routing(tokens, experts, top_k, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(experts - 1, generator=g)[:top_k] for _ in range(tokens)])
    return idx, torch.rand(tokens, top_k, generator=g)  # expert experts-1 gets no token


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        accumulate = func.overloadpacket.__name__.startswith("index_put") and (
            kwargs.get("accumulate") or (len(args) > 3 and args[3]))
        self.seen.append("index_put(accumulate)" if accumulate else func.overloadpacket.__name__)
        return func(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_match_eager_loop_without_scatter_adds(model_dirs, dtype):
    """The experts alone against transformers' per-expert loop: output and the gradients of the
    tokens, routing weights and both expert weights; forward + backward run no index_add_ /
    scatter-add / accumulating index_put_."""
    fused, _ = _pair(model_dirs["flash-small"], dtype)
    experts = fused.model.layers[1].mlp.experts
    assert isinstance(experts, DeepseekV4Experts)
    idx, w = _routing(50, 16, 6, seed=2)
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    w, grad = w.to(dtype), torch.randn(50, 64).to(dtype)
    results = []
    for impl in ("eager", IMPLEMENTATION):
        fused.set_experts_implementation(impl)
        experts.zero_grad()
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        ops = _Ops()
        with ops:
            out = experts(xi, idx, wi)
            out.backward(grad)
        results.append((out, xi.grad, wi.grad, experts.gate_up_proj.grad.clone(),
                        experts.down_proj.grad.clone()))
    assert experts.gate_up_proj.grad[15].abs().max() == 0  # the expert no token chose
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, want, got in zip(("out", "d_x", "d_weights", "d_gate_up", "d_down"), *results):
        assert _rel(got.float(), want.float()) < tol, name
    scatter = {"index_add", "index_add_", "scatter_add", "scatter_add_", "index_put(accumulate)"}
    assert not scatter & set(ops.seen), scatter & set(ops.seen)
    assert "argsort" in ops.seen or "sort" in ops.seen


def test_misaligned_expert_weights_take_the_loop(model_dirs):
    """A weight viewed 3 elements into a flat buffer (as DeepSpeed's can be, after V4's
    3-element mixer `scale`) is not aligned for the CUDA grouped GEMM; the per-expert loop
    gives the same values from it."""
    fused, _ = _pair(model_dirs["flash-small"], torch.float32)
    experts = fused.model.layers[1].mlp.experts
    idx, w = _routing(20, 16, 6, seed=5)
    x = torch.randn(20, 64)
    with torch.no_grad():
        want = experts(x, idx, w)
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(experts, name)
            flat = torch.zeros(3 + p.numel())
            flat[3:] = p.detach().flatten()
            p.data = flat[3:].view_as(p)
        assert not moe.aligned(experts.gate_up_proj) and moe.aligned(x)
        torch.testing.assert_close(experts(x, idx, w), want, rtol=0, atol=0)


def test_experts_forward_refuses_transformers_ep_sentinels():
    class Stub:
        _is_expert_parallel = True
    with pytest.raises(NotImplementedError, match="rl.trainer.expert_parallel"):
        experts_forward(Stub(), torch.zeros(1, 4), torch.zeros(1, 1, dtype=torch.long),
                        torch.ones(1, 1))


def test_compiled_graphs_match_and_do_not_recompile(model_dirs, monkeypatch):
    """With compile on (here a backend that only counts and runs dynamo's graph): every fused
    function traces whole (fullgraph), gives the eager values, and a new sequence length
    compiles nothing new."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fused, _ = _pair(model_dirs["flash-small"], torch.float32)
    torch._dynamo.reset()
    monkeypatch.setattr(compiled, "BACKEND", counting)
    results = {}
    for mode in ("0", "1"):
        monkeypatch.setenv(compiled.ENV, mode)
        results[mode] = [_run(fused, _ids(fused, 24))]
        first = len(graphs)
        results[mode] += [_run(fused, _ids(fused, seq)) for seq in (40, 56)]
    # hc_pre, hc_post (attention; routed + shared), hc_head, rms_norm (a graph per width), swiglu,
    # swiglu_pair, the attention's q_prep and out_unrope (rl.models.v4_attention.module)
    assert first >= 11, first
    assert len(graphs) == first  # sequence lengths 40 and 56 compiled nothing new
    for (want_logits, want), (logits, got) in zip(results["0"], results["1"]):
        # eagerly hc_post mixes with one matmul, compiled with an unrolled sum: fp32 rounding
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
        assert max(_rel(got[n], want[n]) for n in want) < 1e-4
    torch._dynamo.reset()


def test_compile_switch(monkeypatch):
    monkeypatch.delenv(compiled.ENV, raising=False)
    assert not compiled.enabled(torch.device("cpu"))
    assert compiled.enabled(torch.device("cuda"))
    monkeypatch.setenv(compiled.ENV, "0")
    assert not compiled.enabled(torch.device("cuda"))
    monkeypatch.setenv(compiled.ENV, "yes")
    with pytest.raises(ValueError, match="RL_V4_COMPILE='yes'; expected auto, 0 or 1"):
        compiled.enabled(torch.device("cpu"))


def test_generation_with_cache_matches_transformers(model_dirs):
    fused, ref = _pair(model_dirs["tiny-deepseek-v4"], torch.float32)
    ids = _ids(fused, seq=12, seed=4)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(fused.eval().generate(ids, **kw), ref.eval().generate(ids, **kw))


def test_compile_only_with_grad_and_eager_after_the_recompile_limit(monkeypatch, caplog):
    """Generation (no grad) never compiles; a function past dynamo's recompile limit runs
    eagerly from then on instead of failing the step (the HF engine on CUDA hit this)."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    monkeypatch.setattr(compiled, "BACKEND", counting)
    monkeypatch.setenv(compiled.ENV, "1")
    # dynamo's own patch: monkeypatch's undo deletes these config entries (vLLM then fails)
    limits = torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False)
    limits.__enter__()
    try:
        _past_the_limit(graphs, caplog)
    finally:
        limits.__exit__(None, None, None)
        torch._dynamo.reset()


def _past_the_limit(graphs, caplog):
    square = compiled.Fused(lambda x: x * x + 1, token_args=1)
    with torch.no_grad():
        square(torch.ones(3, 4))
    assert graphs == []
    x = torch.ones(3, 4, requires_grad=True)
    assert square(x).sum().item() == 24
    assert len(graphs) == 1
    with caplog.at_level("WARNING"):
        y = torch.ones(3, 5, requires_grad=True)  # a new width: past the limit of 1
        assert square(y).sum().item() == 30
        assert square(torch.ones(2, 7, requires_grad=True)).sum().item() == 28
    assert len(graphs) == 1 and square._eager
    assert sum("recompile limit" in r.message for r in caplog.records) == 1


def test_compiled_functions_get_aligned_inputs(monkeypatch):
    """DeepSpeed's flat-buffer views can sit off 16 bytes (V4's 3-element `scale`); inductor's
    kernels then fault on CUDA ("misaligned address"). A compiled call sees aligned copies
    only, and the gradient still reaches the misaligned view."""
    pointers = []

    def recording(gm, example_inputs):
        def run(*inputs):
            pointers.extend(t.data_ptr() for t in inputs if isinstance(t, torch.Tensor))
            return gm.forward(*inputs)
        return run

    torch._dynamo.reset()
    monkeypatch.setattr(compiled, "BACKEND", recording)
    monkeypatch.setenv(compiled.ENV, "1")
    flat = torch.zeros(3 + 8, dtype=torch.bfloat16, requires_grad=True)
    weight = flat[3:]  # 6 bytes into the buffer, as after the hyper-connection `scale`
    assert weight.data_ptr() % compiled.ALIGNMENT
    x = torch.randn(5, 8, dtype=torch.bfloat16, requires_grad=True)
    try:
        out = hyper.rms_norm(x, weight, 1e-6)
    finally:
        torch._dynamo.reset()
    assert pointers and all(p % compiled.ALIGNMENT == 0 for p in pointers)
    out.float().sum().backward()
    assert flat.grad[3:].abs().sum() > 0 and flat.grad[:3].abs().sum() == 0
    ref = hyper._rms_norm(x.detach(), weight.detach(), 1e-6)
    assert torch.equal(out.detach(), ref)

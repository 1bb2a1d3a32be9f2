"""The native engine's FP8 KV cache (`rollout.kv_cache_dtype: fp8`), torch reference path:
quantisation error bound, decode attention against the full-precision cache, capacity (the
engine's and the planner's), and the engine end to end."""
import pytest
import torch

from rl.config import RolloutConfig, load_config
from rl.rollout.base import SamplingParams
from rl.rollout.native import kernels as K
from rl.rollout.native.kvcache import KVCache, dequantize_kv, kv_scales, quantize_kv
from rl.rollout.native.model import NativeQwen3, Shape

# Qwen3-0.6B's attention (28 layers, 8 KV heads of 128), with a narrow residual stream and a
# small vocabulary.
QWEN3_06B_KV = dict(vocab=256, hidden=128, layers=28, nh=16, nkv=8, head_dim=128, inter=256,
                    eps=1e-6, rope_theta=1e6, tied=True, is_moe=(False,) * 28)


def heads(*shape, seed=0):
    """Random heads whose magnitudes span ~6 decades, within and across heads."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    return x * torch.exp(2 * torch.randn(*shape[:-1], 1, generator=g)) * torch.exp(
        torch.randn(*shape, generator=g))


def test_quantise_error_bound_and_scale_range():
    x = heads(64, 8, 128)
    x[0, 0] = 0.0                                              # an all-zero head stays zero
    x8, exp = quantize_kv(x)
    assert x8.dtype == torch.float8_e4m3fn and exp.dtype == torch.uint8 and exp.shape == (64, 8)
    scale = kv_scales(exp)
    assert torch.equal(torch.log2(scale), torch.log2(scale).round())    # powers of two
    ratio = x.abs().amax(-1)[1:] / scale[1:]                 # largest element in (224, 448]
    assert (ratio > 224).all() and (ratio <= 448).all()
    err = (dequantize_kv(x8, exp) - x).abs()
    # Round to nearest on 3 mantissa bits: half a step, 2**-4 of |x| (normal range) or 2**-10
    # of the scale (e4m3 subnormals).
    bound = torch.maximum(x.abs() * 2 ** -4, scale[..., None] * 2 ** -10)
    assert (err <= bound * (1 + 1e-6)).all()
    assert err.max() > 0 and torch.equal(dequantize_kv(x8, exp)[0, 0], x[0, 0])
    rel = err.norm() / x.norm()
    assert 0.005 < rel < 0.05, rel                           # measured 0.028


def test_decode_attention_over_fp8_cache_is_close_to_full_precision():
    b, nh, nkv, d, length = 4, 16, 8, 128, 300
    g = torch.Generator().manual_seed(1)
    # Scores of a few units (K after Qwen3's k_norm); V magnitudes vary by token and head.
    q = torch.randn(b, nh, d, generator=g) * 0.5
    k = torch.randn(b, nkv, length, d, generator=g) * torch.exp(torch.randn(d, generator=g) / 2)
    v = torch.randn(b, nkv, length, d, generator=g) * torch.exp(
        torch.randn(b, nkv, length, 1, generator=g))
    start = torch.tensor([0, 7, 100, 250], dtype=torch.int32)
    pos = torch.tensor([length - 1], dtype=torch.int32)
    (k8, ke), (v8, ve) = quantize_kv(k), quantize_kv(v)
    ref = K.decode_attention(q, k, v, start, pos, d ** -0.5, "torch")
    out = K.decode_attention(q, k8, v8.transpose(-1, -2), start, pos, d ** -0.5, "torch",
                             k_exp=ke, v_exp=ve)                       # FP8 V is stored (D, L)
    rel = ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert 0 < rel < 0.06, rel                               # measured 0.039 (mean 0.030)


def test_the_cache_holds_twice_the_sequences_and_the_planner_agrees():
    from rl.plan import arch
    from rl.plan.memory import plan_rollout

    shape = Shape(**QWEN3_06B_KV)
    models = {fp8: NativeQwen3(shape, torch.device("meta"), torch.bfloat16, False, None, 1152,
                               "torch", kv_fp8=fp8) for fp8 in (False, True)}   # no storage
    per_seq = {fp8: m.cache_bytes(1) for fp8, m in models.items()}
    # 2 x 8 heads x 28 layers x 1152 tokens x (128 B + 1 scale byte) vs 256 B of bf16.
    assert per_seq[True] == 2 * 8 * 28 * 1152 * 129 and per_seq[False] == 2 * 8 * 28 * 1152 * 256
    budget = 100 * 2 ** 30
    rows = {fp8: m.max_cache_rows(budget) for fp8, m in models.items()}
    assert rows == {False: 812, True: 1612} and rows[True] >= 1.98 * rows[False]
    # A cache that does not fit names the setting and how many rows would (GPU free memory).
    models[False]._free_bytes = lambda: 5.5 * per_seq[False]
    with pytest.raises(ValueError, match=r"rollout.max_batch_size: a KV cache for 8 sequences "
                                         r".* at most 5 fit \(rollout.kv_cache_dtype: fp8"):
        models[False].ensure_cache(8)
    # What the allocation really takes: FP8 rows padded to whole 128-slot tiles, V transposed.
    cache = KVCache(2, 3, 8, 200, 128, torch.bfloat16, torch.device("cpu"), fp8=True)
    allocated = sum(t.numel() * t.element_size() for t in (cache.k, cache.v, cache.k_exp,
                                                            cache.v_exp))
    assert allocated == 3 * 256 * KVCache.bytes_per_token(2, 8, 128, 2, True)
    assert cache.k.shape == (2, 3, 8, 256, 128) and cache.v.shape == (2, 3, 8, 128, 256)
    padded = NativeQwen3(shape, torch.device("meta"), torch.bfloat16, False, None, 1100, "torch",
                         kv_fp8=True)
    assert padded.cache_bytes(1) == per_seq[True]      # 1,100 slots hold 1,152 (9 tiles)

    config = {"model_type": "qwen3", "vocab_size": 256, "hidden_size": 128,
              "intermediate_size": 256, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True}
    plans = {}
    for kv in ("auto", "fp8"):
        cfg = load_config(None, ["rollout.engine=native", f"rollout.kv_cache_dtype={kv}",
                                 "rollout.max_model_len=1152", "rollout.max_new_tokens=1024",
                                 "cluster.rollout.gpus_per_node=1"])
        plans[kv] = plan_rollout(cfg, arch.parse(config, "qwen3-0.6b"))
    assert plans["fp8"].kv.per_token * 1152 == per_seq[True]
    assert plans["auto"].kv.per_token * 1152 == per_seq[False]
    room = next(ln.gpu for ln in plans["fp8"].lines if ln.label.startswith("KV cache"))
    assert plans["fp8"].concurrent == models[True].max_cache_rows(room)
    assert plans["fp8"].concurrent >= 1.98 * plans["auto"].concurrent
    # A max_model_len off the 128-slot grid: the planner pads the rows as the engine does.
    cfg = load_config(None, ["rollout.engine=native", "rollout.kv_cache_dtype=fp8",
                             "rollout.max_model_len=1100", "rollout.max_new_tokens=1000",
                             "cluster.rollout.gpus_per_node=1"])
    off_grid = plan_rollout(cfg, arch.parse(config, "qwen3-0.6b"))
    room = next(ln.gpu for ln in off_grid.lines if ln.label.startswith("KV cache"))
    assert off_grid.concurrent == padded.max_cache_rows(room) == plans["fp8"].concurrent


@pytest.fixture(scope="module")
def kv_engines(model_dir):
    from rl.rollout.native.engine import NativeEngine

    torch.set_num_threads(1)
    make = lambda kv: NativeEngine(model_dir, RolloutConfig(  # noqa: E731
        engine="native", max_model_len=128, kv_cache_dtype=kv), dtype="float32", device="cpu")
    return make("auto"), make("fp8")


def test_a_decode_step_reads_exactly_the_quantised_cache(kv_engines, monkeypatch):
    """One decode step from the FP8 cache = prefill whose last query attends over
    dequantise(quantise(K, V)) (the earlier queries over exact K, V, as the cache was written)."""
    import torch.nn.functional as F

    model = kv_engines[1].model
    ids = torch.tensor([[1, 20, 21, 14, 22, 32, 40]])
    start = torch.zeros(1, dtype=torch.int32)
    model.ensure_cache(1)
    model.prefill(ids[:, :6], start, write_cache=True)
    decoded = model.decode_step(ids[:, 6], start, torch.tensor([6], dtype=torch.int32))
    exact = model.logits(model.prefill(ids, start, write_cache=False)[:, -1])
    sdpa = F.scaled_dot_product_attention
    fake = lambda x: dequantize_kv(*quantize_kv(x))  # noqa: E731

    def last_query_over_fp8(q, k, v, **kw):
        out = sdpa(q, k, v, **kw)
        out[:, :, -1] = sdpa(q, fake(k), fake(v), **kw)[:, :, -1]
        return out
    monkeypatch.setattr(F, "scaled_dot_product_attention", last_query_over_fp8)
    simulated = model.logits(model.prefill(ids, start, write_cache=False)[:, -1])
    assert (decoded - simulated).abs().max() < 1e-4                    # measured 2.6e-6
    assert (decoded - exact).abs().max() > 1e-2                        # FP8 is really in use


def test_engine_logprobs_with_the_fp8_cache(kv_engines, prompts):
    full, fp8 = kv_engines
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=3)
    samples = [s for g in fp8.generate(prompts, sp) for s in g]
    assert fp8.model.cache.fp8 and fp8.model.cache.k.dtype == torch.float8_e4m3fn
    # Decode log-probs (FP8 cache) against exact prefill scores of the same tokens: the mean is
    # the sampled-token estimate of KL(fp8 || exact). This tiny model's LM head is scaled x8,
    # which magnifies every logit error; measured: KL 0.002, mean |diff| 0.04, max 0.31.
    exact = full.score([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    diffs = torch.tensor([a - b for s, r in zip(samples, exact) for a, b in zip(s.logprobs, r)])
    assert abs(diffs.mean()) < 0.01 and diffs.abs().mean() < 0.1 and diffs.abs().max() < 0.8

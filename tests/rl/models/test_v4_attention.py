"""rl.models.v4_attention against transformers' eager DeepSeek-V4 attention, on CPU in fp32."""
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4ForCausalLM

from rl.models.hf_classes import transformers_classes
from rl.models.loading import load_model
from rl.models.v4_attention import install
from rl.models.v4_attention.chunked import v4_attention
from rl.models.v4_attention.module import LinearV4Attention

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def eager_model():
    return _eager_v4()


def _eager_v4(**overrides):
    # Small dims so the test is fast; one layer of each kind, windows that several query blocks
    # cross (block 16 < S), an HCA rate with several entries, padding in the second row.
    config_cls, _ = transformers_classes("deepseek_v4")
    fields = dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, q_lora_rank=16, qk_rope_head_dim=8,
        moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        o_groups=2, o_lora_rank=8, index_n_heads=8, index_head_dim=16, index_topk=3,
        layer_types=["sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["moe", "moe", "moe"], sliding_window=6, hc_mult=2,
        hc_sinkhorn_iters=3, max_position_embeddings=256, attn_implementation="eager")
    cfg = config_cls(**{**fields, **overrides})
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(cfg).float()
    with torch.no_grad():  # init leaves sinks / position biases at 0: make them matter
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias")):
                p.normal_(0, 1.0)
    return model.train()


def _loss_and_grads(model, ids, mask):
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    loss = (logits.log_softmax(-1)[..., 1:, :].gather(-1, ids[:, 1:, None])[..., 0]
            * mask[:, 1:]).sum()
    loss.backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_model_matches_eager_outputs_and_gradients(eager_model, monkeypatch):
    monkeypatch.setattr("rl.models.v4_attention.chunked.QUERY_BLOCK", 16)
    monkeypatch.setattr("rl.models.v4_attention.compress.INDEXER_BLOCK", 16)
    linear = copy.deepcopy(eager_model)
    assert install(linear) == 3
    torch.manual_seed(1)
    ids = torch.randint(1, 64, (2, 57))
    mask = torch.ones(2, 57, dtype=torch.long)
    mask[1, 41:] = 0
    ref_logits, ref_grads = _loss_and_grads(eager_model, ids, mask)
    logits, grads = _loss_and_grads(linear, ids, mask)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    scale = max(g.abs().max() for g in ref_grads.values() if g is not None)
    checked = set()
    for name, ref in ref_grads.items():
        got = grads[name]
        assert (got is None) == (ref is None), name
        if ref is not None:
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5 * scale, msg=name)
            checked.add(name)
    # gradients reach the sinks, q / kv projections and both compressors (CSA in layer 1, HCA
    # in 2); the indexer gets none in eager either (its output is a top-k index)
    for layer in (1, 2):
        for part in ("sinks", "q_b_proj.weight", "kv_proj.weight", "compressor.kv_proj.weight",
                     "compressor.gate_proj.weight", "compressor.position_bias"):
            name = f"model.layers.{layer}.self_attn.{part}"
            assert name in checked and ref_grads[name].abs().max() > 0, name
    assert grads["model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"] is None


def test_generation_with_cache_matches_eager(eager_model):
    linear = copy.deepcopy(eager_model).eval()
    install(linear)
    ids = torch.randint(1, 64, (1, 20), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    want = eager_model.eval().generate(ids, **kw)
    eager_model.train()
    assert torch.equal(linear.generate(ids, **kw), want)


def test_block_attention_masks_window_picks_and_padding():
    # One query sees: its window (i-2 < j <= i, valid), its CSA picks, and the sink.
    torch.manual_seed(3)
    B, H, S, D, T = 1, 2, 5, 4, 3
    q, kv, comp = torch.randn(B, H, S, D), torch.randn(B, S, D), torch.randn(B, T, D)
    sinks = torch.randn(H)
    topk = torch.tensor([[[-1, -1], [-1, -1], [0, -1], [2, 0], [1, -1]]])
    valid = torch.tensor([[True, False, True, True, True]])
    out = v4_attention(q, kv, comp, topk, None, valid, sinks, 0.5, window=3, block=2)
    i = 3  # keys 2, 3 (1 is outside the window... and padding), entries 2 and 0
    keys = torch.cat([kv[0, 2:4], comp[0, [2, 0]]])
    logits = torch.cat([q[0, :, i] @ keys.T * 0.5, sinks[:, None]], dim=1)
    want = logits.softmax(-1)[:, :-1] @ keys
    torch.testing.assert_close(out[0, :, i], want)


def test_load_model_runs_linear_attention_for_v4_by_default(preset_dirs):
    d = preset_dirs["tiny-deepseek-v4"]
    kinds = {type(m) for m in load_model(d, torch.float32).modules()}
    assert LinearV4Attention in kinds
    eager = load_model(d, torch.float32, attention="eager")
    assert LinearV4Attention not in {type(m) for m in eager.modules()}
    assert eager.config._attn_implementation == "eager"


def _interpreted(call: str) -> list[str]:
    # The GPU path in Triton's CPU interpreter, in a fresh process: the interpreter must be on
    # before anything imports triton. One-pass backward tiles of DV=16 < head_dim 32: the split is
    # tested; the two-pass backward's pass 2 reads tiles twice as wide as pass 1 writes.
    env = {**os.environ, "TRITON_INTERPRET": "1", "RL_V4_ATTENTION_BWD_TILES": "16,16,4,1",
           "RL_V4_ATTENTION_BWD2_SCORES_TILES": "16,4,1",
           "RL_V4_ATTENTION_BWD2_GRADS_TILES": "32,16,4,1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    code = ("from tests.rl.models.test_v4_attention import indexer_case, one_pass_case, "
            f"triton_case; {call}")
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, timeout=900,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


def test_triton_path_matches_chunked_path():
    # Triton forward + the two-pass Triton backward (the default), and Triton forward + the
    # torch recompute backward, against the chunked path: fp32 output and every gradient, each
    # layer kind, with padding; then the pinned tiles of both passes (they ran).
    assert _interpreted("triton_case('float32')") == [
        "csa", "hca", "sliding", "16,4,1", "32,16,4,1"]


@pytest.mark.slow
def test_triton_path_in_bf16_matches_chunked_path():
    assert _interpreted("triton_case('bfloat16')") == [
        "csa", "hca", "sliding", "16,4,1", "32,16,4,1"]


def test_one_pass_triton_backward_matches_chunked_path():
    assert _interpreted("one_pass_case('float32')") == ["csa", "hca", "sliding", "16,16,4,1"]


@pytest.mark.slow
def test_one_pass_triton_backward_in_bf16_matches_chunked_path():
    assert _interpreted("one_pass_case('bfloat16')") == ["csa", "hca", "sliding", "16,16,4,1"]


def _bf16_dots_in_interpreter():
    # Triton 3.9's interpreter multiplies bf16 dot operands as their raw uint16 storage; widen
    # them to fp32 first (exact, as the tensor cores' products are; sums in fp32 either way).
    import triton.language as tl
    from triton.runtime import interpreter
    create_dot = interpreter.InterpreterBuilder.create_dot

    def widened(self, a, b, *rest):
        a, b = (self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x
                for x in (a, b))
        return create_dot(self, a, b, *rest)
    interpreter.InterpreterBuilder.create_dot = widened


def _modes_match_chunked(dtype_name: str, impls: tuple[str, ...]):
    from tests.rl.models.v4_attention_cases import compare, make_case

    dtype = getattr(torch, dtype_name)
    if dtype == torch.bfloat16:
        _bf16_dots_in_interpreter()
    for mode in ("csa", "hca", "sliding"):
        # the sliding case's window of 20 spans two key tiles of 16
        errors = compare(make_case(mode, window=20 if mode == "sliding" else 6), dtype,
                         impls=impls)
        # fp32: equal to rounding. bf16: against the fp32 truth, within a few bf16 roundings
        # (the torch paths' own error is ~4e-3; the Triton backward's delta = dO.O uses the
        # bf16 output, as FlashAttention's does: up to ~9e-3 on dsinks)
        bound = 1e-5 if dtype == torch.float32 else 2e-2
        for impl, errs in errors.items():  # all(): max() would pass over a NaN
            assert all(e < bound for e in errs.values()), (mode, impl, errs)
        print(mode)


def triton_case(dtype_name: str):
    """The default: the two-pass backward (`triton_bwd2`), its buffers a few tokens' worth: per
    token 2 x 16 padded heads x 128 key columns (CSA, HCA; sliding 64) x 4 bytes (fp32; bf16 2),
    so chunks of 25 or 50 tokens run over the 2 x 29: two or three chunks, the last partial."""
    from rl.models.v4_attention import triton_bwd2
    triton_bwd2.CHUNK_BYTES = 25 * 2 * 16 * 128 * 4
    _modes_match_chunked(dtype_name, ("triton", "triton_torch_bwd"))
    for tiles in (triton_bwd2.SCORES, triton_bwd2.GRADS):  # both passes ran, pinned tiles
        (config,) = tiles.tuned.values()
        print(",".join(map(str, config)))


def one_pass_case(dtype_name: str):
    from rl.models.v4_attention import triton_bwd
    _modes_match_chunked(dtype_name, ("triton_one_pass",))
    (tiles,) = triton_bwd.TUNED.values()  # the one-pass backward ran, with the pinned tiles
    print(",".join(map(str, tiles)))


def indexer_case(dtype_name: str):
    """The Triton indexer scores (`triton_indexer`) against the per-head torch scores, and
    `indexer_topk` through it against its torch path on the eager fixture's CSA layer."""
    from rl.models.v4_attention import compress, kernel
    from rl.models.v4_attention.triton_indexer import index_scores

    dtype = getattr(torch, dtype_name)
    if dtype == torch.bfloat16:
        _bf16_dots_in_interpreter()
    g = torch.Generator().manual_seed(0)
    B, S, H, D, T = 2, 600, 4, 32, 150  # 64-row blocks: rows 0-63 see < 17 entries, so the
    # entry tiles 1 and 2 of the first block are skipped (written -inf, nothing summed)
    q = torch.randn(B, S, H, D, generator=g).to(dtype)
    k = torch.randn(B, T, D, generator=g).to(dtype)
    w = torch.randn(B, S, H, generator=g)
    thr = ((torch.arange(S) + 1) // 4).expand(B, -1).clone()
    thr[1, 300:] = 0  # a row that sees nothing: all -inf
    got = index_scores(q, k, w, thr)
    want = torch.relu(torch.einsum("bshd,btd->bsht", q.float(), k.float()))
    want = (want * w.unsqueeze(-1)).sum(2)
    want = want.masked_fill(torch.arange(T).view(1, 1, -1) >= thr.unsqueeze(-1), float("-inf"))
    assert torch.equal(got.isinf(), want.isinf())
    seen = ~want.isinf()
    torch.testing.assert_close(got[seen], want[seen], rtol=1e-5, atol=1e-4)
    # the whole indexer: the same picks as its torch path (in any order)
    model = _eager_v4()
    layer = model.model.layers[1].self_attn
    indexer = layer.compressor.indexer
    x = torch.randn(2, 37, 32, generator=g).to(dtype)
    residual = torch.randn(2, 37, indexer.q_b_proj.in_features, generator=g).to(dtype)
    pos = torch.arange(37).unsqueeze(0)
    indexer.to(dtype)
    picks = {}
    for force in ("torch", "triton"):
        kernel.FORCE = force
        picks[force] = compress.indexer_topk(indexer, x, residual, pos, block=16)
    kernel.FORCE = ""
    a, b = picks["torch"].sort(-1).values, picks["triton"].sort(-1).values
    assert (a >= 0).any() and (a < 0).any()
    assert torch.equal(a, b), (a != b).nonzero()
    print("indexer", dtype_name)


def test_triton_indexer_matches_torch():
    assert _interpreted("indexer_case('float32'); indexer_case('bfloat16')") == [
        "indexer", "float32", "indexer", "bfloat16"]


def test_indexer_head_dim_the_triton_tiles_cannot_take_runs_in_torch(monkeypatch):
    """The Triton indexer tiles a power-of-two head dim of at least 16: any other takes the
    torch scores even where the attention runs in Triton (here forced on CPU, where a Triton
    launch would fail)."""
    from rl.models.v4_attention import compress, kernel
    indexer = _eager_v4(index_head_dim=24).model.layers[1].self_attn.compressor.indexer
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 40, 32, generator=g)
    residual = torch.randn(1, 40, indexer.q_b_proj.in_features, generator=g)
    pos = torch.arange(40).unsqueeze(0)
    want = compress.indexer_topk(indexer, x, residual, pos)
    monkeypatch.setattr(kernel, "FORCE", "triton")
    assert torch.equal(compress.indexer_topk(indexer, x, residual, pos), want)


def test_bad_backward_switch_and_tile_pins_are_one_line_errors(monkeypatch):
    from rl.models.v4_attention import kernel, triton_bwd, triton_bwd2
    from tests.rl.models.v4_attention_cases import make_case
    case = make_case("sliding")
    monkeypatch.setattr(kernel, "FORCE", "triton")
    monkeypatch.setattr(kernel, "BACKWARD", "triton2")
    with pytest.raises(ValueError, match="RL_V4_ATTENTION_BWD='triton2': expected triton, "
                                         "triton_one_pass or torch"):
        kernel.attention(case["q"], case["kv"], None, None, None, None, case["sinks"], 1.0, 6)
    # the pins: BLOCK_N past the buffers' padding, a DV that does not divide head_dim, a field
    # missing, not numbers
    for tiles, text, want in ((triton_bwd2.SCORES, "128,8,1", "BLOCK_N >= 16 and <= 64"),
                              (triton_bwd2.GRADS, "64,48,4,2", "DV >= 16 dividing head_dim 512"),
                              (triton_bwd.TILES, "32,256,8", "BLOCK_N,DV,num_warps,num_stages"),
                              (triton_bwd2.GRADS, "a,b,c,d", "BLOCK_N,DV,num_warps,num_stages")):
        monkeypatch.setenv(tiles.env, text)
        with pytest.raises(ValueError, match=f"{tiles.env}='{text}': expected .*{want}"):
            tiles((512, 64, torch.float64), None)
    assert (512, 64, torch.float64) not in triton_bwd2.GRADS.tuned

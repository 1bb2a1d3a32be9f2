"""`trainer.pack_sequences`: the rows of a micro-batch end to end in one sequence, per-row
positions, attention within each row (`rl.trainer.packing`, `rl.models.varlen`). The layout, the
forward and backward of every model family against the padded path, the budget rule, the refusals,
and on a real TrainerWorker (two DeepSpeed ranks, plain processes, gloo) the same log-probs,
step statistics and updated weights as the padded path, for tiny Qwen3-MoE and DeepSeek-V4,
ZeRO-2 and ZeRO-3, fp32 and BF16 (DeepSeek-V3's attention is covered at the model level)."""
import random

import pytest
import torch

from rl.config import ConfigError, load_config
from rl.trainer.batch import TrainBatch
from rl.trainer.microbatch import micro_batches, pad_batch, split_by_budget
from rl.trainer.packing import check_packable, pack, unpack


def test_pack_lays_rows_end_to_end_in_one_sequence():
    mb = pad_batch([[1, 5], [1], [1, 4]], [[6, 7, 8], [9], [3]])  # lengths 5, 2, 3
    p = pack(mb.input_ids, mb.attention_mask)
    assert p.input_ids.tolist() == [[1, 5, 6, 7, 8, 1, 9, 1, 4, 3]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1, 2]]
    assert p.cu_seq_lens.tolist() == [0, 5, 7, 10] and p.cu_seq_lens.dtype == torch.int32
    assert p.max_length == 5
    assert p.targets.tolist() == [[5, 6, 7, 8, 1, 9, 1, 4, 3]]
    kwargs = p.model_kwargs()
    assert "attention_mask" not in kwargs and kwargs["cu_seq_lens_q"] is p.cu_seq_lens
    # predictions inside a row only: (row, col) <- position in the sequence
    assert list(zip(p.rows.tolist(), p.cols.tolist(), p.at.tolist())) == [
        (0, 0, 0), (0, 1, 1), (0, 2, 2), (0, 3, 3), (1, 0, 5), (2, 0, 7), (2, 1, 8)]
    values = torch.arange(9, dtype=torch.float32).view(1, 9).requires_grad_()
    out = unpack(values, p)
    assert out.tolist() == [[0, 1, 2, 3], [5, 0, 0, 0], [7, 8, 0, 0]]
    out.sum().backward()
    assert values.grad.tolist() == [[1, 1, 1, 1, 0, 1, 0, 1, 1]]  # across a row's end: unused


def test_row_bounds_come_from_the_host_at_packing_time(monkeypatch):
    """Every attention layer asks for the rows' bounds: a packed batch carries them from the
    host, so no layer reads the (GPU) cumulative lengths back."""
    from rl.models import varlen
    mb = pad_batch([[1, 5], [1], [1, 4]], [[6, 7, 8], [9], [3]])
    p = pack(mb.input_ids, mb.attention_mask)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("read back"))
    assert varlen.row_bounds(p.cu_seq_lens) == [(0, 5), (5, 7), (7, 10)]
    monkeypatch.undo()
    cu = torch.tensor([0, 3, 4], dtype=torch.int32)  # not packed here: read once, then kept
    assert varlen.row_bounds(cu) == [(0, 3), (3, 4)]
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("read twice"))
    assert varlen.row_bounds(cu) == [(0, 3), (3, 4)]


def _rows(long: bool = False, seed: int = 0):
    """Rows of 11-25 tokens, or (`long`) 40-300 tokens and three of 3-6 (no compressed
    entry yet)."""
    g = torch.Generator().manual_seed(seed)
    sizes = ([(20, 280), (1, 1), (30, 10), (2, 1), (100, 40), (1, 4), (8, 200)] if long
             else [(3, 7), (9, 1), (5, 12), (20, 4)])
    return pad_batch([[1] + torch.randint(3, 100, (p,), generator=g).tolist() for p, _ in sizes],
                     [torch.randint(3, 100, (r,), generator=g).tolist() for _, r in sizes])


def _logprobs_and_grads(model, mb, packed: bool, cross_rows: bool = False):
    from rl.trainer import losses
    from rl.trainer.packing import model_inputs
    model.zero_grad(set_to_none=True)
    kwargs, targets, layout = model_inputs(mb.input_ids, mb.attention_mask, packed, "cpu")
    if cross_rows:  # the rows' bounds withheld: attention over the whole sequence
        kwargs = {k: v for k, v in kwargs.items() if not k.startswith(("cu_seq", "max_len"))}
    logp = losses.token_logprobs(model(**kwargs).logits[:, :-1], targets)
    if layout is not None:
        logp = unpack(logp, layout)
    logp = logp * mb.resp_mask[:, 1:]
    logp.sum().backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return logp.detach().float(), grads


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-deepseek-v4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_forward_and_backward_equal_the_padded_ones(tmp_path_factory, preset, dtype):
    """The model the trainer loads, with the packed attention it installs (`rl.models.varlen`;
    fp32: the padded path's values; BF16: no further from the fp32 padded path than the BF16
    padded path is, since both round differently;
    DeepSeek-V4: its compressor windows, indexer and sliding window row by row; the tiny V4 gets
    rows of 3-300 tokens, which span its CSA windows of 4 (and rows too short for one), top-4
    picks, HCA windows of 128 and its sliding window of 16)."""
    from rl.config import ModelConfig
    from rl.models.loading import load_model, resolve_model_dir
    from rl.trainer.packing import install
    model_dir = resolve_model_dir(ModelConfig(preset=preset),
                                  tmp_path_factory.getbasetemp() / "packing-models")
    model = load_model(str(model_dir), dtype=getattr(torch, dtype), device="cpu",
                       attention="auto").train()
    install(model)
    mb = _rows(long=preset == "tiny-deepseek-v4")
    ref_logp, ref_grads = _logprobs_and_grads(model, mb, packed=False)
    logp, grads = _logprobs_and_grads(model, mb, packed=True)
    assert grads.keys() == ref_grads.keys()
    if dtype == "float32":
        assert (logp - ref_logp).abs().max().item() <= 1e-5
        for name, g in grads.items():
            ref = ref_grads[name]
            assert (g - ref).abs().max().item() <= 1e-4 * (ref.abs().max().item() + 1e-6), name
    else:  # BF16: the packed path is no further from fp32 than the padded path is
        exact = load_model(str(model_dir), dtype=torch.float32, device="cpu",
                           attention="auto").train()
        install(exact)
        true_logp, true_grads = _logprobs_and_grads(exact, mb, packed=False)
        assert ((logp - true_logp).abs().max().item()
                <= 1.25 * (ref_logp - true_logp).abs().max().item() + 0.01)
        for name, g in grads.items():
            true = true_grads[name]
            assert ((g - true).norm().item() <= 1.25 * (ref_grads[name] - true).norm().item()
                    + 0.02 * true.norm().item() + 1e-6), name
    # Without the row bounds the same sequence gives other log-probs: the bounds are what keeps
    # rows apart.
    crossed, _ = _logprobs_and_grads(model, mb, packed=True, cross_rows=True)
    assert (crossed - ref_logp).abs().max().item() > 0.05


def test_packed_attention_on_the_cpu_is_causal_per_row():
    from rl.models.varlen import packed_attention
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, 10, 8, generator=g) for h in (4, 2, 2))  # grouped heads
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    out = packed_attention(q, k, v, cu, 7, None)
    assert out.shape == (1, 10, 4, 8)
    for a, b in ((0, 3), (3, 10)):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, a:b], k[:, :, a:b].repeat_interleave(2, 1), v[:, :, a:b].repeat_interleave(2, 1),
            is_causal=True)
        torch.testing.assert_close(out[:, a:b], ref.transpose(1, 2))


def test_packed_budget_counts_real_tokens():
    lengths = [3, 9, 2, 2, 7, 1]
    assert split_by_budget(list(range(6)), lengths, 10, packed=True) == [[0], [1], [2, 3], [4, 5]]
    assert split_by_budget([0, 2, 3, 5], lengths, 10, packed=True) == [[0, 2, 3, 5]]
    assert split_by_budget([1], lengths, 4, packed=True) == [[1]]  # a longer row is a group of its own
    # padded: rows x the longest row (3 rows of 3, 2, 2 cost 9; four with the 1 too cost 12)
    assert split_by_budget([0, 2, 3, 5], lengths, 10) == [[0, 2, 3], [5]]
    batch = TrainBatch(prompt_ids=[[1]] * 6, response_ids=[[2] * (n - 1) for n in lengths],
                       rollout_logprobs=[[-1.0] * (n - 1) for n in lengths], advantages=[1.0] * 6)
    padded = micro_batches(batch, list(range(6)), 10, 1)
    packed = micro_batches(batch, list(range(6)), 10, 1, packed=True)
    assert len(packed) < len(padded)  # 4 vs 5: the budget no longer pays for padding
    assert [m.index for m in packed] == [[0], [1], [2, 3], [4, 5]]


def test_eager_v4_sliding_windows_and_routing_replay_are_refused():
    with pytest.raises(ValueError, match=r"trainer\.pack_sequences: got true, expected false "
                                         r"with trainer\.attention_kernel eager for deepseek_v4"):
        check_packable({"model_type": "deepseek_v4"}, "eager")
    check_packable({"model_type": "deepseek_v4", "layer_types": ["sliding_attention"]},
                   "auto")  # rl.models.v4_attention packs, windows included
    check_packable({"model_type": "qwen3_moe"}, "eager")  # eager means SDPA there
    with pytest.raises(ValueError, match=r"expected false for qwen3 with sliding-window"):
        check_packable({"model_type": "qwen3", "layer_types": ["full_attention",
                                                                 "sliding_attention"]})
    with pytest.raises(ValueError, match=r"expected false for qwen3 with sliding-window"):
        check_packable({"model_type": "qwen3", "use_sliding_window": True})
    with pytest.raises(ConfigError, match=r"trainer\.pack_sequences: got True, expected false "
                                          r"with algorithm\.routing_replay r2 or r3"):
        load_config("configs/local.yaml", ["trainer.pack_sequences=true",
                                           "algorithm.routing_replay=r3"])
    assert load_config("configs/local.yaml", ["trainer.pack_sequences=true"]).trainer.pack_sequences
    assert load_config("configs/local_v4.yaml",
                       ["trainer.pack_sequences=true"]).trainer.pack_sequences


def _long_tail_batch(n: int = 12, seed: int = 3) -> TrainBatch:
    """Responses of 1 to 24 tokens, most short: padding to the longest wastes most tokens."""
    rng = random.Random(seed)
    prompts = [[1] + [rng.randrange(3, 100) for _ in range(rng.randrange(2, 7))] for _ in range(n)]
    responses = [[rng.randrange(3, 100) for _ in range(min(24, int(rng.expovariate(0.2)) + 1))]
                 for _ in range(n)]
    return TrainBatch(prompt_ids=prompts, response_ids=responses,
                      rollout_logprobs=[[-4.5] * len(r) for r in responses],
                      advantages=[1.0 if i % 2 else -1.0 for i in range(n)])


def _run(model_dir, packed: bool, zero_stage: int, dtype: str) -> dict:
    from rl.cluster.actors import ProcActor, wait_all
    from rl.cluster.groups import free_port
    from rl.config import AlgorithmConfig, SyncConfig, TrainerConfig
    from rl.trainer.worker import RankInfo, TrainerWorker
    # One micro-batch per rank either way (the budget rules differ, and the logged statistics
    # are means over micro-batches), all of a rank's rows packed into one sequence.
    cfg = TrainerConfig(num_ranks=2, zero_stage=zero_stage, device="cpu", lr=1e-3,
                        micro_batch_tokens=4096, num_mini_batches=1, grad_clip=1.0,
                        pack_sequences=packed)
    algo = AlgorithmConfig(kl_coef=0.05, entropy_coef=0.01)
    port = free_port()
    ranks = [ProcActor(TrainerWorker, cfg, algo, SyncConfig(), str(model_dir), dtype,
                       RankInfo(rank=r, world_size=2, master_addr="127.0.0.1", master_port=port),
                       0, 10, name=f"{'packed' if packed else 'padded'}{r}") for r in range(2)]
    try:
        wait_all([a.ready for a in ranks], timeout=900)
        batch = _long_tail_batch()
        out = {"score": wait_all([a.call("score", batch.prompt_ids, batch.response_ids)
                                  for a in ranks], timeout=600)[0]}
        out["stats"] = [s for s in wait_all([a.call("train_step", batch, 1) for a in ranks],
                                            timeout=900)]
        out["state"] = wait_all([a.call("full_state_dict") for a in ranks], timeout=600)[0]
    finally:
        for a in ranks:
            a.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("preset, zero_stage, dtype", [
    ("tiny-qwen3-moe", 3, "float32"),
    ("tiny-qwen3-moe", 2, "bfloat16"),
    ("tiny-deepseek-v4", 3, "bfloat16")])
def test_packed_trainer_matches_the_padded_one(tmp_path, preset, zero_stage, dtype):
    from rl.config import ModelConfig
    from rl.models.loading import resolve_model_dir
    model_dir = resolve_model_dir(ModelConfig(preset=preset), tmp_path / "models")
    ref = _run(model_dir, False, zero_stage, dtype)
    got = _run(model_dir, True, zero_stage, dtype)
    bf16 = dtype == "bfloat16"
    for a, b in zip(got["score"], ref["score"]):  # every response token's log-prob
        assert a == pytest.approx(b, abs=0.05 if bf16 else 2e-5)
    s_got, s_ref = got["stats"][0].metrics, ref["stats"][0].metrics
    assert s_got["train/skipped"] == 0 and s_got["train/grad_norm"] > 0
    for key in ("train/loss", "train/pg_loss", "train/kl", "train/entropy", "train/grad_norm"):
        assert s_got[key] == pytest.approx(s_ref[key], rel=5e-2 if bf16 else 1e-4,
                                           abs=1e-3 if bf16 else 1e-6), key
    for r in range(2):  # the old log-probs each rank hands back, in sample order
        old_got, old_ref = got["stats"][r].old_logprobs, ref["stats"][r].old_logprobs
        assert set(old_got) == set(old_ref)
        for i, row in old_ref.items():
            assert old_got[i] == pytest.approx(row, abs=0.05 if bf16 else 2e-5), i
    for name, t in got["state"].items():
        diff = (t.double() - ref["state"][name].double()).abs().max().item()
        assert diff <= (2 ** -7 + 2e-3 if bf16 else 2e-4), (name, diff)

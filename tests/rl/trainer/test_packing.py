"""`trainer.pack_sequences`: the rows of a micro-batch end to end, per-row positions and a
block-diagonal causal mask (`rl.trainer.packing`). The layout, the budget rule, the refusals,
and on a real TrainerWorker (two DeepSpeed ranks, plain processes, gloo) the same log-probs,
step statistics and updated weights as the padded path, for tiny Qwen3-MoE and DeepSeek-V3,
ZeRO-2 and ZeRO-3, fp32 and BF16."""
import random

import pytest
import torch

from rl.config import ConfigError, load_config
from rl.trainer.batch import TrainBatch
from rl.trainer.microbatch import micro_batches, pad_batch, split_by_budget
from rl.trainer.packing import check_packable, pack, unpack


def test_pack_lays_rows_end_to_end_in_bins_of_the_longest_row():
    # lengths 5, 2, 3: row 0 fills a bin of 5; rows 1 and 2 share the second (first fit)
    mb = pad_batch([[1, 5], [1], [1, 4]], [[6, 7, 8], [9], [3]])
    p = pack(mb.input_ids, mb.attention_mask)
    assert p.input_ids.tolist() == [[1, 5, 6, 7, 8], [1, 9, 1, 4, 3]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 0, 1, 2]]
    assert p.targets.tolist() == [[5, 6, 7, 8], [9, 1, 4, 3]]
    mask = p.attention_mask[1, 0]
    assert mask[1].tolist() == [True, True, False, False, False]  # row 1's last token: its own
    assert mask[4].tolist() == [False, False, True, True, True]  # row 2 never sees row 1
    assert not p.attention_mask[0, 0, 0, 1]  # causal
    # predictions inside a row only: (row, col) <- (bin, position)
    assert list(zip(p.rows.tolist(), p.cols.tolist(), p.bins.tolist(), p.at.tolist())) == [
        (0, 0, 0, 0), (0, 1, 0, 1), (0, 2, 0, 2), (0, 3, 0, 3),
        (1, 0, 1, 0), (2, 0, 1, 2), (2, 1, 1, 3)]
    values = torch.arange(8, dtype=torch.float32).view(2, 4).requires_grad_()
    out = unpack(values, p)
    assert out.tolist() == [[0, 1, 2, 3], [4, 0, 0, 0], [6, 7, 0, 0]]
    out.sum().backward()
    assert values.grad.tolist() == [[1, 1, 1, 1], [1, 0, 1, 1]]  # position 1 -> row 2: unused


def test_a_bin_with_padding_masks_no_query_row_entirely():
    mb = pad_batch([[1, 5], [1]], [[6, 7, 8], [9]])  # lengths 5 and 2: the second bin pads 3
    p = pack(mb.input_ids, mb.attention_mask)
    assert p.input_ids.tolist() == [[1, 5, 6, 7, 8], [1, 9, 0, 0, 0]]
    assert bool(p.attention_mask.any(-1).all())  # SDPA returns NaN for an all-masked query
    assert p.attention_mask[1, 0, 3].tolist() == [False, False, False, True, False]


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


def test_v4_and_routing_replay_are_refused():
    with pytest.raises(ValueError, match=r"trainer\.pack_sequences: got true, expected false "
                                         r"for DeepSeek-V4"):
        check_packable("deepseek_v4")
    check_packable("qwen3_moe")
    with pytest.raises(ConfigError, match=r"trainer\.pack_sequences: got True, expected false "
                                          r"with algorithm\.routing_replay r2 or r3"):
        load_config("configs/local.yaml", ["trainer.pack_sequences=true",
                                           "algorithm.routing_replay=r3"])
    with pytest.raises(ConfigError, match=r"trainer\.pack_sequences: got True, expected false "
                                          r"for DeepSeek-V4"):
        load_config("configs/local_v4.yaml", ["trainer.pack_sequences=true"])
    assert load_config("configs/local.yaml", ["trainer.pack_sequences=true"]).trainer.pack_sequences


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
    ("tiny-deepseek-v3", 2, "float32"),
    ("tiny-qwen3-moe", 2, "bfloat16")])
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

"""`trainer.chunked_lm_head` on a real TrainerWorker: two DeepSpeed ranks (plain processes, gloo)
score, train one step (two optimizer steps, several micro-batches each) and gather their weights
with the chunked head and with full logits, from the same start. The log-probs, the step's
statistics (loss, KL to the reference model, entropy bonus, gradient norm) and the updated
weights must agree: under ZeRO-3 (the head's weight partitioned, gathered only inside its
module's hooks) and ZeRO-2, for tiny Qwen3-MoE (also with the head tied to the embeddings) and
tiny DeepSeek-V4, in fp32 and in BF16."""
import json

import pytest
import torch

from rl.cluster.actors import ProcActor, wait_all
from rl.cluster.groups import free_port
from rl.config import AlgorithmConfig, ModelConfig, SyncConfig, TrainerConfig
from rl.models.loading import resolve_model_dir
from rl.trainer.worker import RankInfo, TrainerWorker
from tests.helpers.batches import random_batch

pytestmark = pytest.mark.slow


def _tied_dir(model_dir, out):
    """The preset with its head tied to the input embeddings (`tie_word_embeddings: true`;
    the saved files hold the embedding only)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    model.config.tie_word_embeddings = True
    model.get_output_embeddings().weight = model.get_input_embeddings().weight
    model.save_pretrained(str(out))
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    back = AutoModelForCausalLM.from_pretrained(str(out))
    assert back.get_output_embeddings().weight is back.get_input_embeddings().weight
    return out


def _run(model_dir, chunked: bool, zero_stage: int, dtype: str) -> dict:
    # BF16: one optimizer step, so that every statistic comes from the same weights. Adam's
    # first update is ~lr x sign(gradient): where a gradient is near zero, bf16 rounding flips
    # its sign and the weights part by 2 lr, which moved a second mini-batch's loss by 1%
    # (-0.02563 vs -0.02539, measured); fp32 takes two steps.
    cfg = TrainerConfig(num_ranks=2, zero_stage=zero_stage, device="cpu", lr=1e-3,
                        micro_batch_tokens=24, num_mini_batches=1 if dtype == "bfloat16" else 2,
                        grad_clip=1.0, chunked_lm_head=chunked, lm_head_chunk_rows=7)
    # KL runs the reference model's head too; the entropy bonus differentiates the entropy
    algo = AlgorithmConfig(kl_coef=0.05, entropy_coef=0.01)
    port = free_port()
    ranks = [ProcActor(TrainerWorker, cfg, algo, SyncConfig(), str(model_dir), dtype,
                       RankInfo(rank=r, world_size=2, master_addr="127.0.0.1", master_port=port),
                       0, 10, name=f"{'chunked' if chunked else 'full'}{r}") for r in range(2)]
    try:
        wait_all([a.ready for a in ranks], timeout=900)
        batch = random_batch(8, seed=2)
        out = {"kernels": wait_all([a.call("kernels") for a in ranks], timeout=60)}
        out["score"] = wait_all([a.call("score", batch.prompt_ids, batch.response_ids)
                                 for a in ranks], timeout=600)[0]
        out["start"] = wait_all([a.call("full_state_dict") for a in ranks], timeout=600)[0]
        out["stats"] = [s.metrics for s in wait_all([a.call("train_step", batch, 1)
                                                     for a in ranks], timeout=900)]
        out["state"] = wait_all([a.call("full_state_dict") for a in ranks], timeout=600)[0]
    finally:
        for a in ranks:
            a.close()
    return out


@pytest.mark.parametrize("preset, zero_stage, dtype, tied", [
    ("tiny-qwen3-moe", 3, "float32", False),
    ("tiny-qwen3-moe", 3, "float32", True),
    ("tiny-qwen3-moe", 2, "float32", False),
    ("tiny-deepseek-v4", 3, "float32", False),
    ("tiny-qwen3-moe", 3, "bfloat16", True),
    ("tiny-deepseek-v4", 2, "bfloat16", False)])
def test_chunked_head_trains_like_full_logits(tmp_path, preset, zero_stage, dtype, tied):
    model_dir = resolve_model_dir(ModelConfig(preset=preset), tmp_path / "models")
    if tied:
        model_dir = _tied_dir(model_dir, tmp_path / "tied")
    ref = _run(model_dir, False, zero_stage, dtype)
    got = _run(model_dir, True, zero_stage, dtype)

    assert [k["lm_head"] for k in got["kernels"]] == ["chunked"] * 2  # the switch took effect
    assert [k["lm_head"] for k in ref["kernels"]] == ["full"] * 2
    assert set(got["state"]) == set(ref["state"])  # the names the weight sync sends
    # V4's sync sends DeepSeek's checkpoint names (embed.weight, head.weight)
    embed = next(n for n in ("model.embed_tokens.weight", "embed.weight") if n in got["state"])
    heads = [n for n in ("lm_head.weight", "head.weight") if n in got["state"]]
    assert len(heads) == (0 if tied else 1), heads
    for name, t in got["start"].items():
        assert torch.equal(t, ref["start"][name]), name
    bf16 = dtype == "bfloat16"
    for a, b in zip(got["score"], ref["score"]):
        assert a == pytest.approx(b, abs=1e-5)  # the same logits (model dtype) either way
    s_got, s_ref = got["stats"][0], ref["stats"][0]
    print({k: (s_got[k], s_ref[k]) for k in sorted(s_ref) if k != "train/tokens_per_s"})
    assert {k: v for k, v in got["stats"][1].items() if k != "train/tokens_per_s"} == {
        k: v for k, v in s_got.items() if k != "train/tokens_per_s"}  # the ranks agree
    assert s_got["train/skipped"] == 0 and s_got["train/grad_norm"] > 0
    for key in ("train/loss", "train/pg_loss", "train/kl", "train/entropy", "train/grad_norm"):
        rel = 2e-2 if bf16 and key == "train/grad_norm" else 1e-4
        assert s_got[key] == pytest.approx(s_ref[key], rel=rel, abs=1e-6), key

    # The updated weights. Both paths train (the head and the embeddings move).
    moved = [n for n in got["state"] if not torch.equal(got["state"][n], got["start"][n])]
    assert embed in moved and all(h in moved for h in heads)
    diffs = []
    for name, t in got["state"].items():
        r = ref["state"][name]
        step = (r.double() - got["start"][name].double()).abs().max().item()
        diff = (t.double() - r.double()).abs()
        # fp32: Adam moves an entry whose gradient sits near eps by a visible part of lr, at
        # most a tenth of a step per optimizer step (1e-4 measured once here, 3.5e-5 in
        # tests/rl/trainer/test_expert_parallel.py); bf16: an entry lands on a neighbouring
        # bf16 value (one ulp of a weight ~1 is 2^-7)
        assert diff.max() <= (2 ** -7 + 2e-3 if bf16 else 2e-4), (name, diff.max(), step)
        diffs.append(diff.flatten())
    diffs = torch.cat(diffs)
    print(f"weights: mean |chunked - full| {diffs.mean():.3g}, max {diffs.max():.3g}, "
          f"entries that differ {(diffs > 0).double().mean():.3g}")
    assert diffs.mean() < (1e-5 if bf16 else 1e-8), diffs.mean()

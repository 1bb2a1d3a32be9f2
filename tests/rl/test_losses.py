"""Losses against hand-computed numbers (derivations in the comments, not the formula re-run)."""
import math

import pytest
import torch

from rl.config import AlgorithmConfig
from rl.trainer.losses import (entropy_from_logits, grpo_advantages, kl_penalty, masked_aggregate,
                               policy_loss, ppo_clip_loss, tis_weights, token_logprobs)

torch.set_num_threads(1)
LN2 = 0.6931471805599453


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                               torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# ------------------------------------------------------------------ advantages
REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 3.0]])


def test_advantages_centred_without_std():
    # Row means 0.5, 2, 0.75.
    close(grpo_advantages(REWARDS, normalize_std=False),
          [[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0], [-0.75, -0.75, -0.75, 2.25]])


def test_advantages_divided_by_unbiased_std():
    # Row 0: squares sum 4 * 0.25 = 1, / (4-1) -> std sqrt(1/3) = 0.57735; 0.5 / 0.57735 = 0.866025.
    # Row 2: squares 3 * 0.5625 + 5.0625 = 6.75, / 3 = 2.25 -> std 1.5; -0.75/1.5, 2.25/1.5.
    close(grpo_advantages(REWARDS, normalize_std=True),
          [[0.866025, -0.866025, -0.866025, 0.866025], [0, 0, 0, 0], [-0.5, -0.5, -0.5, 1.5]])


def test_degenerate_groups_are_exactly_zero():
    # 0.1 is not exact in binary: the centred values may be ~1e-9, which 1/(std+eps) would blow up.
    adv = grpo_advantages(torch.tensor([[0.1, 0.1, 0.1]]), normalize_std=True)
    assert torch.equal(adv, torch.zeros(1, 3))
    assert torch.equal(grpo_advantages(torch.tensor([[3.0]]), normalize_std=True), torch.zeros(1, 1))
    with pytest.raises(ValueError, match="num_prompts, n_samples"):
        grpo_advantages(torch.zeros(4), normalize_std=True)


# ------------------------------------------------------------------ PPO clip
# Two sequences, A = +1 and -1, each with ratios [1.0, 1.5, 0.5]; clip_low 0.2, clip_high 0.28.
RATIOS = torch.tensor([[1.0, 1.5, 0.5], [1.0, 1.5, 0.5]])
ADV = torch.tensor([1.0, -1.0])


def _clip(mask, loss_agg="token", requires_grad=False):
    logp = torch.log(RATIOS).clone().requires_grad_(requires_grad)
    return logp, ppo_clip_loss(logp, torch.zeros(2, 3), ADV, mask, 0.2, 0.28, loss_agg)


def test_clip_both_sides_and_negative_advantages():
    # Per token max(-A r, -A clip(r, 0.8, 1.28)):
    #  A=+1: r=1 -> -1; r=1.5 -> max(-1.5, -1.28) = -1.28 (high clip); r=0.5 -> max(-0.5, -0.8) = -0.5
    #  A=-1: r=1 -> 1;  r=1.5 -> max(1.5, 1.28) = 1.5;  r=0.5 -> max(0.5, 0.8) = 0.8 (low clip)
    # Token mean: (-2.78 + 3.3) / 6 = 0.0866667.
    logp, (loss, stats) = _clip(torch.ones(2, 3), requires_grad=True)
    close(loss, 0.0866667)
    close(stats["clip_frac_high"], 1 / 6)
    close(stats["clip_frac_low"], 1 / 6)
    close(stats["ratio_mean"], 1.0)
    # approx_kl = mean of (r-1) - ln r: 0, 0.5 - ln 1.5 = 0.0945349, -0.5 + ln 2 = 0.1931472, twice.
    close(stats["approx_kl"], 0.0958940)
    # d/dlogp of -A r is -A r; clipped tokens get 0; every token / 6.
    loss.backward()
    close(logp.grad, [[-1 / 6, 0.0, -0.5 / 6], [1 / 6, 1.5 / 6, 0.0]])


def test_token_and_sequence_aggregation_differ():
    # Second sequence has 2 valid tokens: losses [-1, -1.28, -0.5] and [1, 1.5].
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    _, (token_loss, _) = _clip(mask, "token")
    _, (seq_loss, _) = _clip(mask, "sequence")
    close(token_loss, (-2.78 + 2.5) / 5)  # -0.056: every token weighs the same
    close(seq_loss, (-2.78 / 3 + 2.5 / 2) / 2)  # 0.161667: every sequence weighs the same
    assert token_loss < 0 < seq_loss


def test_aggregate_with_global_denominator_sums_over_micro_batches():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    full = masked_aggregate(x, mask, "token")  # (1 + 2 + 4 + 5 + 6) / 5 = 3.6
    close(full, 3.6)
    parts = [masked_aggregate(x[i:i + 1], mask[i:i + 1], "token", agg_denominator=5.0) for i in (0, 1)]
    close(sum(parts), 3.6)
    # sequence: means 1.5 and 5 -> 3.25; with 2 sequences as denominator per micro-batch too.
    close(masked_aggregate(x, mask, "sequence"), 3.25)
    close(sum(masked_aggregate(x[i:i + 1], mask[i:i + 1], "sequence", 2.0) for i in (0, 1)), 3.25)
    # An all-padding sequence is not counted as a sequence.
    close(masked_aggregate(x, torch.tensor([[0.0, 0, 0], [1, 1, 1]]), "sequence"), 5.0)


# ------------------------------------------------------------------ KL
def test_kl_k1_k3_values():
    logp = torch.log(torch.tensor([0.5, 0.25, 0.3]))
    ref = torch.log(torch.tensor([0.25, 0.5, 0.3]))
    # k1 = ln .5 - ln .25 = ln 2; ln .25 - ln .5 = -ln 2; equal -> 0.
    close(kl_penalty(logp, ref, "k1"), [LN2, -LN2, 0.0])
    # k3 with d = ref - logp: d = -ln2 -> 0.5 + ln2 - 1 = 0.193147; d = ln2 -> 2 - ln2 - 1 = 0.306853.
    close(kl_penalty(logp, ref, "k3"), [0.1931472, 0.3068528, 0.0])
    with pytest.raises(ValueError, match="k1"):
        kl_penalty(logp, ref, "k2")


# ------------------------------------------------------------------ TIS
def test_tis_weights_cap_and_stats():
    ratios = torch.tensor([[0.5, 1.0, 1.5, 3.0]])
    w, stats = tis_weights(torch.log(ratios), torch.zeros(1, 4), cap=2.0)
    close(w, [[0.5, 1.0, 1.5, 2.0]])
    close(stats["tis_ratio_mean"], 1.5)  # (0.5 + 1 + 1.5 + 3) / 4, before the cap
    close(stats["tis_ratio_max"], 3.0)
    close(stats["tis_ratio_min"], 0.5)
    close(stats["tis_capped_frac"], 0.25)
    # Masked-out tokens do not count.
    _, stats = tis_weights(torch.log(ratios), torch.zeros(1, 4), 2.0, mask=torch.tensor([[1, 1, 1, 0]]))
    close(stats["tis_ratio_mean"], 1.0)
    close(stats["tis_ratio_max"], 1.5)
    close(stats["tis_capped_frac"], 0.0)
    with pytest.raises(ValueError, match="tis_cap"):
        tis_weights(torch.zeros(1, 1), torch.zeros(1, 1), cap=0.5)


def test_policy_loss_combines_tis_kl_entropy():
    # One sequence, A = +1, logp = old_logp (ratio 1), rollout ratios 0.5 and 4 -> TIS weights 0.5, 2.
    cfg = AlgorithmConfig(tis_cap=2.0, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
    logp = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_(True)
    old = logp.detach().clone()
    rollout = old - torch.log(torch.tensor([[0.5, 4.0]]))
    ref = old + LN2  # k3 with ref - logp = ln 2: 0.306853 per token
    loss, stats = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), cfg,
                              rollout_logp=rollout, ref_logp=ref, entropy=torch.tensor([[1.0, 3.0]]))
    # pg = mean(-0.5, -2) = -1.25; + 0.1 * 0.306853 - 0.01 * mean(1, 3) = -1.2393147.
    close(loss, -1.2393147)
    assert stats["pg_loss"] == pytest.approx(-1.25, abs=1e-6)
    assert stats["kl"] == pytest.approx(0.3068528, abs=1e-6)
    assert stats["entropy"] == pytest.approx(2.0)
    assert stats["tis_capped_frac"] == pytest.approx(0.5)
    assert stats["tis_ratio_max"] == pytest.approx(4.0)
    assert all(isinstance(v, float) for v in stats.values())
    # Gradient: pg -A r w / 2 = [-0.25, -1.0] (weights detached); k3' = 1 - e^(ref-logp) = -1,
    # times 0.1 / 2 = -0.05 each.
    loss.backward()
    close(logp.grad, [[-0.3, -1.05]])


def test_policy_loss_stats_are_batch_means_under_global_denominator():
    # Token losses of _clip's batch: [-1, -1.28, -0.5] and [1, 1.5, 0.8]; each sequence on its own
    # as a micro-batch of a 6-token mini-batch: loss tensors -2.78/6 and 3.3/6 (they sum to the
    # mini-batch mean 0.0866667), reported pg_loss -2.78/3 and 3.3/3 (each micro-batch's mean).
    cfg = AlgorithmConfig(tis_cap=None)
    logp = torch.log(RATIOS)
    results = [policy_loss(logp[i:i + 1], torch.zeros(1, 3), ADV[i:i + 1], torch.ones(1, 3), cfg,
                           agg_denominator=6.0) for i in (0, 1)]
    close(results[0][0] + results[1][0], 0.0866667)
    assert results[0][1]["pg_loss"] == pytest.approx(-2.78 / 3, abs=1e-5)
    assert results[1][1]["loss"] == pytest.approx(3.3 / 3, abs=1e-5)


def test_policy_loss_stable_keys_and_missing_inputs():
    cfg = AlgorithmConfig(tis_cap=None)
    x = torch.zeros(2, 3)
    _, stats = policy_loss(x, x, torch.zeros(2), torch.ones(2, 3), cfg)
    assert set(stats) == {"loss", "pg_loss", "clip_frac_low", "clip_frac_high", "approx_kl",
                          "ratio_mean"}
    with pytest.raises(ValueError, match="tis_cap"):
        policy_loss(x, x, torch.zeros(2), torch.ones(2, 3), AlgorithmConfig(tis_cap=2.0))
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(x, x, torch.zeros(2), torch.ones(2, 3), AlgorithmConfig(tis_cap=None, kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(x, x, torch.zeros(2), torch.ones(2, 3),
                    AlgorithmConfig(tis_cap=None, entropy_coef=0.1))


# ------------------------------------------------------------------ logits
def test_entropy_from_logits():
    # Uniform over 4: ln 4 = 1.386294. Probabilities (0.25, 0.75): 0.25 ln 4 + 0.75 ln(4/3) = 0.562335.
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e4, -1e4]]])
    close(entropy_from_logits(logits), [[1.3862944, 0.5623351]])
    close(entropy_from_logits(logits, chunk_rows=1), [[1.3862944, 0.5623351]])


def test_token_logprobs_values_temperature_and_stability():
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)], [1000.0, 0.0]]])
    tokens = torch.tensor([[1, 0, 1]])
    # p = (0.25, 0.75): ln 0.75 = -0.287682, ln 0.25 = -1.386294; the 1000-logit row: -1000 exactly.
    close(token_logprobs(logits, tokens), [[-0.2876821, -1.3862944, -1000.0]], atol=1e-3)
    # Temperature 2: p1 = sqrt3 / (1 + sqrt3) = 0.633975, ln = -0.455746.
    close(token_logprobs(logits[:, :1], tokens[:, :1], temperature=2.0), [[-0.4557464]])
    # bf16 logits come back as float32, chunked or not.
    out = token_logprobs(logits.bfloat16(), tokens, chunk_rows=1)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="do not match"):
        token_logprobs(logits, tokens[:, :2])

"""GRPO / PPO policy losses: advantages, clipped surrogate, KL, truncated importance sampling.

Pure torch (no DeepSpeed); every function works on CPU and GPU tensors of any float dtype.

Shapes: B sequences (prompt-sample pairs), T response-token positions (padded), V vocabulary.
`mask_BT` is 1 on response tokens that count and 0 on padding and prompt positions. Log-probs are
natural-log probabilities of the sampled tokens, `(B, T)`. Advantages are one value per sequence,
`(B,)`, broadcast over its tokens.

Three log-probs meet here:
- `logp`: the policy being optimised (carries gradient);
- `old_logp`: the trainer's log-probs of the same weights that generated the batch, computed once
  before the first optimizer step (the PPO anchor);
- `rollout_logp`: what the rollout engine reported while sampling. It differs from `old_logp` by
  kernels, precision (FP8 rollouts) and, when asynchronous, staleness; truncated importance
  sampling (TIS) corrects the gradient for that mismatch.

Aggregation (`loss_agg`): "token" averages over every valid token of the batch (long answers weigh
more); "sequence" averages within each sequence first and then over sequences (each sample weighs
the same). For gradient accumulation over micro-batches pass `agg_denominator`: the number of valid
tokens ("token") or sequences ("sequence") of the whole mini-batch across micro-batches and ranks,
so that summing the micro-batch losses gives the mini-batch mean.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from rl.config import AlgorithmConfig

# exp() of a log-ratio beyond this is clamped: float32 overflows at exp(88), and ratios this large
# only appear on broken batches, which the statistics must still report as finite numbers.
_MAX_LOG_RATIO = 20.0

LossAgg = Literal["token", "sequence"]


def grpo_advantages(rewards_G: Tensor, normalize_std: bool, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages: `(num_prompts, n_samples)` rewards -> same-shape float32.

    Each row (the samples of one prompt) is centred on its mean; with `normalize_std` it is also
    divided by `std + eps`, where std is the unbiased (Bessel-corrected) sample std, as in the
    GRPO paper's reference code. A group whose rewards are all equal (including a group of one)
    carries no signal and gets exactly 0, not a rounding residue amplified by 1/eps.
    """
    if rewards_G.dim() != 2:
        raise ValueError(f"rewards_G: expected shape (num_prompts, n_samples), got {tuple(rewards_G.shape)}")
    rewards_G = rewards_G.float()
    centred_G = rewards_G - rewards_G.mean(dim=1, keepdim=True)
    degenerate_G1 = (rewards_G.amax(dim=1, keepdim=True) == rewards_G.amin(dim=1, keepdim=True))
    if normalize_std and rewards_G.shape[1] > 1:
        centred_G = centred_G / (rewards_G.std(dim=1, keepdim=True) + eps)
    return centred_G.masked_fill(degenerate_G1, 0.0)


def masked_aggregate(x_BT: Tensor, mask_BT: Tensor, loss_agg: LossAgg,
                     agg_denominator: float | None = None) -> Tensor:
    """Reduce per-token values to a scalar by `loss_agg` (see the module docstring).

    Without `agg_denominator`: "token" = sum(x*mask)/sum(mask); "sequence" = mean over sequences
    that have at least one valid token of each sequence's masked mean. An all-padding batch gives 0.
    """
    mask_BT = mask_BT.to(x_BT.dtype)
    if loss_agg == "token":
        total = (x_BT * mask_BT).sum()
        denom = mask_BT.sum() if agg_denominator is None else agg_denominator
    elif loss_agg == "sequence":
        count_B = mask_BT.sum(dim=1)
        seq_mean_B = (x_BT * mask_BT).sum(dim=1) / count_B.clamp(min=1)
        total = seq_mean_B.sum()
        denom = (count_B > 0).sum() if agg_denominator is None else agg_denominator
    else:
        raise ValueError(f"loss_agg: got {loss_agg!r}, expected 'token' or 'sequence'")
    if isinstance(denom, Tensor):
        denom = denom.clamp(min=1)
    elif denom <= 0:
        raise ValueError(f"agg_denominator: got {agg_denominator!r}, expected a value > 0")
    return total / denom


def _masked_mean(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    mask_BT = mask_BT.to(x_BT.dtype)
    return (x_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1)


def ppo_clip_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                  clip_low: float, clip_high: float, loss_agg: LossAgg,
                  tis_weight: Tensor | None = None,
                  agg_denominator: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate loss with asymmetric bounds (clip-higher).

    Per token: ratio = exp(logp - old_logp), loss = max(-A*ratio, -A*clip(ratio, 1-clip_low,
    1+clip_high)) (the pessimistic min of the objectives), times `tis_weight` (detached) when given.

    Args: logp, old_logp, mask, tis_weight `(B, T)`; advantages `(B,)`.
    Returns the scalar loss and detached 0-dim statistics over valid tokens:
      clip_frac_low: fraction with A < 0 and ratio < 1-clip_low (the lower bound is active, the
        token gets no gradient); clip_frac_high: A > 0 and ratio > 1+clip_high;
      approx_kl: KL(old || new) by Schulman's k3 estimator, mean of (ratio - 1) - log(ratio);
      ratio_mean: mean ratio.
    """
    if advantages.dim() != 1 or advantages.shape[0] != logp.shape[0]:
        raise ValueError(f"advantages: expected shape ({logp.shape[0]},), got {tuple(advantages.shape)}")
    log_ratio_BT = (logp - old_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio_BT = torch.exp(log_ratio_BT)
    adv_BT = advantages.to(ratio_BT.dtype).unsqueeze(1)
    loss_unclipped_BT = -adv_BT * ratio_BT
    loss_clipped_BT = -adv_BT * ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_BT = torch.maximum(loss_unclipped_BT, loss_clipped_BT)
    if tis_weight is not None:
        loss_BT = loss_BT * tis_weight.detach()
    loss = masked_aggregate(loss_BT, mask, loss_agg, agg_denominator)

    with torch.no_grad():
        ratio_d = ratio_BT.detach()
        low_BT = (adv_BT < 0) & (ratio_d < 1.0 - clip_low)
        high_BT = (adv_BT > 0) & (ratio_d > 1.0 + clip_high)
        stats = {
            "clip_frac_low": _masked_mean(low_BT.float(), mask),
            "clip_frac_high": _masked_mean(high_BT.float(), mask),
            "approx_kl": _masked_mean(ratio_d - 1.0 - log_ratio_BT.detach(), mask),
            "ratio_mean": _masked_mean(ratio_d, mask),
        }
    return loss, stats


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: Literal["k1", "k3"]) -> Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy, `(B, T)`.

    k1 = logp - ref_logp (unbiased, can be negative); k3 = exp(ref - logp) - (ref - logp) - 1
    (unbiased, always >= 0, lower variance). The k3 log-ratio is clamped to +-20 against overflow.
    """
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k3":
        log_ratio = (ref_logp - logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"kl_estimator: got {estimator!r}, expected 'k1' or 'k3'")


def tis_weights(old_logp_trainer: Tensor, logp_rollout: Tensor, cap: float,
                mask: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance weights `min(exp(old_logp_trainer - logp_rollout), cap)`, `(B, T)`.

    The weights are detached (they rescale the policy gradient, they are not optimised).
    Statistics over valid tokens (all tokens when `mask` is None), of the ratio before the cap:
    tis_ratio_mean, tis_ratio_max, tis_ratio_min, tis_capped_frac (fraction with ratio > cap).
    """
    if cap < 1:
        raise ValueError(f"tis_cap: got {cap!r}, expected a value >= 1")
    with torch.no_grad():
        log_ratio_BT = (old_logp_trainer - logp_rollout).float().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        ratio_BT = torch.exp(log_ratio_BT)
        weights_BT = ratio_BT.clamp(max=cap)
        valid_BT = torch.ones_like(ratio_BT, dtype=torch.bool) if mask is None else mask.bool()
        if valid_BT.any():
            valid_ratios = ratio_BT[valid_BT]
            stats = {
                "tis_ratio_mean": valid_ratios.mean(),
                "tis_ratio_max": valid_ratios.max(),
                "tis_ratio_min": valid_ratios.min(),
                "tis_capped_frac": (valid_ratios > cap).float().mean(),
            }
        else:
            one, zero = ratio_BT.new_tensor(1.0), ratio_BT.new_tensor(0.0)
            stats = {"tis_ratio_mean": one, "tis_ratio_max": one, "tis_ratio_min": one,
                     "tis_capped_frac": zero}
    return weights_BT.to(old_logp_trainer.dtype), stats


def _row_chunks(x: Tensor, chunk_rows: int) -> list[Tensor]:
    return list(x.split(chunk_rows)) if x.shape[0] else [x]


def entropy_from_logits(logits: Tensor, chunk_rows: int = 1024) -> Tensor:
    """Entropy of softmax(logits) over the last dim: `(..., V)` -> `(...)`, float32, differentiable.

    H = logsumexp(l) - sum(softmax(l) * l). Computed in float32 on `chunk_rows` rows at a time so a
    bf16 `(B, T, V)` input never needs a full float32 copy in the forward pass.
    """
    lead_shape, vocab = logits.shape[:-1], logits.shape[-1]
    out = []
    for chunk in _row_chunks(logits.reshape(-1, vocab), chunk_rows):
        chunk = chunk.float()
        probs = torch.softmax(chunk, dim=-1)
        out.append(torch.logsumexp(chunk, dim=-1) - (probs * chunk).sum(dim=-1))
    return torch.cat(out).reshape(lead_shape)


def token_logprobs(logits_BTV: Tensor, tokens_BT: Tensor, temperature: float = 1.0,
                   chunk_rows: int = 1024) -> Tensor:
    """Log-probabilities of `tokens_BT` under softmax(logits / temperature): `(B, T)`, float32.

    logp = l[token] - logsumexp(l), which equals log_softmax(l).gather(token) but never builds the
    `(B, T, V)` log-softmax; rows are processed `chunk_rows` at a time in float32. Pass the rollout
    sampling temperature so the trainer's log-probs match the engine's.
    """
    if logits_BTV.shape[:-1] != tokens_BT.shape:
        raise ValueError(f"token_logprobs: logits {tuple(logits_BTV.shape)} do not match "
                         f"tokens {tuple(tokens_BT.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature: got {temperature!r}, expected a value > 0")
    vocab = logits_BTV.shape[-1]
    flat_logits = logits_BTV.reshape(-1, vocab)
    flat_tokens = tokens_BT.reshape(-1, 1).long()
    out = []
    for lg, tk in zip(_row_chunks(flat_logits, chunk_rows), _row_chunks(flat_tokens, chunk_rows)):
        lg = lg.float()
        if temperature != 1.0:
            lg = lg / temperature
        out.append(lg.gather(-1, tk).squeeze(-1) - torch.logsumexp(lg, dim=-1))
    return torch.cat(out).reshape(tokens_BT.shape)


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                cfg: AlgorithmConfig, *, rollout_logp: Tensor | None = None,
                ref_logp: Tensor | None = None, entropy: Tensor | None = None,
                agg_denominator: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """The GRPO objective: pg loss (with TIS) + kl_coef * KL - entropy_coef * entropy.

    Args (all `(B, T)` except advantages `(B,)`): `rollout_logp` is required when `cfg.tis_cap`
    is set; `ref_logp` when `cfg.kl_coef > 0`; `entropy` (per-token, e.g. from
    `entropy_from_logits`, with gradient) when `cfg.entropy_coef > 0`. KL and entropy are
    aggregated like the pg loss (`cfg.loss_agg`, `agg_denominator`).

    Returns the scalar loss and float statistics. Keys (the loop logs each as `train/<key>`):
    always loss, pg_loss, clip_frac_low, clip_frac_high, approx_kl, ratio_mean; kl when `ref_logp`
    is given; entropy when `entropy` is given; tis_ratio_mean, tis_ratio_max, tis_ratio_min,
    tis_capped_frac when TIS is on. All statistics describe this call's batch alone: loss, pg_loss,
    kl and entropy are its `cfg.loss_agg` means even when `agg_denominator` rescales the returned
    loss tensor, so averaging them over micro-batches gives the mini-batch value (exactly so for
    equal-sized micro-batches); the rest are means (max/min) over its valid tokens.
    """
    if cfg.tis_cap is not None and rollout_logp is None:
        raise ValueError("policy_loss: algorithm.tis_cap is set but no rollout_logp was given "
                         "(set algorithm.tis_cap: null to train without TIS)")
    if cfg.kl_coef > 0 and ref_logp is None:
        raise ValueError("policy_loss: algorithm.kl_coef > 0 needs ref_logp")
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError("policy_loss: algorithm.entropy_coef > 0 needs entropy")

    stats: dict[str, Tensor] = {}
    weight_BT = None
    if cfg.tis_cap is not None:
        weight_BT, tis_stats = tis_weights(old_logp, rollout_logp, cfg.tis_cap, mask)
        stats.update(tis_stats)
    pg_loss, pg_stats = ppo_clip_loss(logp, old_logp, advantages, mask, cfg.clip_low,
                                      cfg.clip_high, cfg.loss_agg, weight_BT, agg_denominator)
    stats.update(pg_stats)
    stats["pg_loss"] = pg_loss.detach()
    loss = pg_loss
    if ref_logp is not None:
        kl = masked_aggregate(kl_penalty(logp, ref_logp, cfg.kl_estimator), mask, cfg.loss_agg,
                              agg_denominator)
        stats["kl"] = kl.detach()
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl
    if entropy is not None:
        ent = masked_aggregate(entropy, mask, cfg.loss_agg, agg_denominator)
        stats["entropy"] = ent.detach()
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * ent
    stats["loss"] = loss.detach()
    if agg_denominator is not None:
        # Undo the global denominator for reporting: value * global / local = this batch's mean.
        mask_f = mask.float()
        local = mask_f.sum() if cfg.loss_agg == "token" else (mask_f.sum(dim=1) > 0).sum()
        scale = agg_denominator / local.clamp(min=1)
        for name in ("loss", "pg_loss", "kl", "entropy"):
            if name in stats:
                stats[name] = stats[name] * scale
    # One device-to-host copy for all statistics instead of one sync per `.item()`.
    names = sorted(stats)
    values = torch.stack([stats[n].float().reshape(()) for n in names]).tolist()
    return loss, dict(zip(names, values))

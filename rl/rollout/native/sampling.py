"""Sampling for the `native` engine: temperature, top-k, top-p from fp32 logits, returning the
raw temperature-1 log-probs of the drawn tokens (the convention in `rl.rollout.base`).

On a GPU, plain temperature sampling (no top-k / top-p; RL's usual setting) runs as two Triton
launches that read the logits once (`kernels.sample_temperature`, inverse CDF over vocabulary
tiles); the torch path (`sample_torch`) reads and writes the (B, vocabulary) logits five to six
times (log-sum-exp, softmax, the exponential race, argmax)."""
from __future__ import annotations

import torch

from rl.rollout.base import SamplingParams
from rl.rollout.native import kernels as K


def sample_tokens(logits: torch.Tensor, sp: SamplingParams, gen: torch.Generator | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V), fp32 or as the LM head wrote them (bf16: read as fp32, exactly) ->
    (tokens (B,), raw temperature-1 log-probs (B,), fp32)."""
    if (logits.is_cuda and not sp.greedy and not 0 < sp.top_k < logits.shape[-1]
            and sp.top_p >= 1.0 and K.triton_available()):
        seed = torch.randint(0, 2 ** 31 - 1, (1,), generator=gen, dtype=torch.int32,
                             device=logits.device)
        return K.sample_temperature(logits, sp.temperature, seed)
    return sample_torch(logits, sp, gen)


def sample_torch(logits: torch.Tensor, sp: SamplingParams, gen: torch.Generator | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_tokens` in torch ops, on any device and with top-k / top-p."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    if sp.greedy:
        tok = logits.argmax(-1)
    else:
        x = logits / sp.temperature if sp.temperature != 1.0 else logits
        if 0 < sp.top_k < x.shape[-1]:
            kth = x.topk(sp.top_k, dim=-1).values[:, -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if sp.top_p < 1.0:
            sorted_x, idx = x.sort(dim=-1, descending=True)
            p = sorted_x.softmax(-1)
            # Drop a token once the mass before it already reaches top_p (the top one stays).
            drop = (p.cumsum(-1) - p) >= sp.top_p
            x = torch.empty_like(x).scatter_(-1, idx, sorted_x.masked_fill(drop, float("-inf")))
        probs = x.softmax(-1)
        # Exponential race (Gumbel-max): argmax p / E with E ~ Exp(1) samples from p.
        race = torch.empty_like(probs).exponential_(generator=gen).clamp_(min=1e-20)
        tok = (probs / race).argmax(-1)
    return tok, logits.gather(-1, tok[:, None]).squeeze(-1) - lse

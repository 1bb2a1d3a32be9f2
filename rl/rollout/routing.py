"""Routing returned by the rollout engines (`SamplingParams.return_routing`), and its format.

A sample's routing is an array of shape (P + R - 1, layers, top_k), P prompt and R response
tokens: row t holds the experts that input token t went to in each routed MoE layer (layer order
of `rl.models.routing.moe_routers`), the rows of every token the engine fed to the model. The
last response token is never an input (nothing is sampled after it), so it has no row; prompt
and response rows follow the same rule. dtype uint8 when the model has <= 256 experts, else
uint16 (`rl.models.routing.routing_dtype`): layers x top_k bytes per token (x2 for uint16).

Which forward the rows come from, per engine:
- `hf`: the scoring forward over prompt + response that also gives the log-probs.
- `native`: the prefill of the prompt and each decode step, i.e. the forward that sampled.
- `vllm`: on CPU vLLM's own `enable_return_routed_experts` is unavailable (it needs Model Runner
  V2, which needs Triton; vLLM-CPU has none), so the worker extension hooks the routers and
  re-runs prompt + response[:-1] as one prefill (prefix cache not read), like the `hf` engine.
"""
from __future__ import annotations

import numpy as np
import torch


def routing_rows(prompt_len: int, response_len: int) -> int:
    """Rows of a sample's routing (see the module docstring)."""
    return prompt_len + response_len - 1


def check_routing(routing: np.ndarray, prompt_len: int, response_len: int, where: str) -> None:
    rows = routing_rows(prompt_len, response_len)
    if routing.ndim != 3 or routing.shape[0] != rows:
        raise ValueError(f"{where}: routing of shape {routing.shape}, expected ({rows}, layers, "
                         f"top_k) for {prompt_len} prompt + {response_len} response tokens")


def split_rows(routing_TNK: torch.Tensor, lengths: list[int], dtype: np.dtype) -> list[np.ndarray]:
    """Consecutive rows of `routing_TNK` cut into one array per sequence of `lengths` rows."""
    out, at = [], 0
    for n in lengths:
        out.append(routing_TNK[at:at + n].cpu().numpy().astype(dtype))
        at += n
    if at != routing_TNK.shape[0]:
        raise RuntimeError(f"routing capture: {routing_TNK.shape[0]} rows for sequences of "
                           f"{sum(lengths)} tokens")
    return out


def pad_routing(routings: list[np.ndarray], starts: list[int], width: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, width, layers, K) int64 with routings[i] placed at row i from position starts[i]
    (zeros elsewhere), and the (B, width) bool mask of the placed rows."""
    _, layers, k = routings[0].shape
    out = torch.zeros((len(routings), width, layers, k), dtype=torch.int64)
    mask = torch.zeros((len(routings), width), dtype=torch.bool)
    for i, (r, s) in enumerate(zip(routings, starts)):
        out[i, s:s + r.shape[0]] = torch.from_numpy(r.astype(np.int64))
        mask[i, s:s + r.shape[0]] = True
    return out, mask


def agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Fraction of (token, layer, expert) choices of `a` also chosen by `b` (same shape)."""
    if a.shape != b.shape:
        raise ValueError(f"routing agreement: shapes {a.shape} and {b.shape} differ")
    if a.size == 0:
        return 1.0
    hits = (a[..., :, None] == b[..., None, :]).any(-1)
    return float(hits.mean())

"""The LM head as the trainer runs it: per-token log-probs (and entropies) straight from the final
hidden states and the head weight, never the whole `(T, V)` logits (`trainer.chunked_lm_head`).

At DeepSeek-V4-Flash scale (vocab V = 129,280, hidden H = 4,096, T = 18,432-token micro-batches)
the logits, their gradient and the fp32 copies the log-softmax keeps take 17.8 GiB per GPU; this
path keeps `chunk_rows x V` logits at a time instead.

Shapes: N rows (tokens, flattened), H hidden, V vocabulary; `hidden_NH` and `weight_VH` in the
model dtype, log-probs and entropies float32.

Forward, `chunk_rows` rows at a time: z = hidden W^T in the model dtype (the GEMM `nn.Linear`
runs), l = float(z) / temperature, and per row the logsumexp, the target's log-prob
l[target] - logsumexp(l) and, when asked, the entropy logsumexp(l) - E_p[l] (p = softmax(l)). Only
the per-row numbers are kept (fp32), with references to `hidden` and the weight.

Backward, vocabulary slice by vocabulary slice (`slice_columns`: chunk_rows x V / N columns, so a
slice holds no more logits than a forward chunk; on CUDA rounded down to a multiple of 128, so
that its rows stay 16-byte aligned for the tensor-core GEMMs): recompute l for the slice, then
dL/dl = g_logp (onehot - p) - g_ent p (l - E_p[l]), divided by the temperature and rounded to the
model dtype (as autograd rounds the logits' gradient). Each slice of the weight's gradient is one
GEMM over all N rows (`dL/dz^T hidden`, fp32 accumulation inside the GEMM, written in the weight's
dtype, as `nn.Linear`'s backward computes it); the hidden states' gradient sums `dL/dz W` over
the slices in an fp32 `(N, H)` buffer and is rounded to the model dtype once at the end (with
one slice, the usual case for short micro-batches, it is the single GEMM `nn.Linear` runs).

Peak memory beyond the inputs, in bytes (e = model dtype bytes): forward 8 x chunk_rows x V
(float(z) and the exp that logsumexp / the entropy need; z itself, e per entry, lives only until
its fp32 copy exists); backward 8 x chunk_rows x V for a slice (l and p), plus N x H x (4 + 4) for
the fp32 accumulator and one slice's fp32 product, plus the gradients themselves (N x H x e for
the hidden states, V x H x e for the weight). `rl.plan.activations` books this.

Under DeepSpeed ZeRO-3 the weight is partitioned and gathered only inside its module's forward
and backward hooks: `LogprobHead` is that module (it replaces the model's `lm_head`, keeping the
same `weight` parameter), so the function runs inside those hooks and its weight gradient reaches
DeepSpeed's reduce hooks like `nn.Linear`'s would.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

DEFAULT_CHUNK_ROWS = 1024


def _logits(hidden: Tensor, weight: Tensor, temperature: float) -> Tensor:
    """fp32 logits / temperature of `hidden` rows against `weight` rows (a fresh tensor)."""
    z = F.linear(hidden, weight)
    logits = z.float() if z.dtype != torch.float32 else z
    del z
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


_fp32_out_mm = True
"""Whether this torch's CUDA `torch.mm` takes `out_dtype` (set False on the first refusal)."""


def _accumulate(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc (fp32) += a @ b with an fp32 result even when `a` and `b` are bf16: on CUDA the bf16
    GEMM writes fp32 directly (`out_dtype`); elsewhere, or where torch lacks it, the operands
    are widened to fp32, which is exact but slower (logged once)."""
    global _fp32_out_mm
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    if a.is_cuda and _fp32_out_mm:
        try:
            acc.add_(torch.mm(a, b, out_dtype=torch.float32))
            return
        except (TypeError, RuntimeError, NotImplementedError) as e:
            _fp32_out_mm = False
            logging.getLogger(__name__).warning(
                "torch.mm(out_dtype=float32) failed (%s): the chunked LM head widens its bf16 "
                "operands to fp32 for the hidden states' gradient instead (slower)", e)
    acc.addmm_(a.float(), b.float())


SLICE_ALIGN = 128
"""On CUDA, backward vocabulary slices are a multiple of this many columns (but the last)."""


def slice_columns(rows: int, vocab: int, chunk_rows: int, align: int = 1) -> int:
    """Columns of each backward vocabulary slice: `chunk_rows` x `vocab` / `rows` (the logits of
    a forward chunk), rounded down to a multiple of `align` (at least `align`), at most `vocab`.
    CUDA passes SLICE_ALIGN: a slice of logits `(rows, cols)` with cols not a multiple of 8 has
    rows off the 16-byte alignment bf16 tensor-core GEMMs need; at V4-Flash's 18,432 tokens and
    1,024 chunk rows (7,182 columns) the chunked head ran at 1.64x the full-logits time on an
    H100, where 8,192 tokens (8,080 columns) ran at 0.96x; aligned (7,168), at 0.95x
    (bench/results/lm_head.md). A slice then exceeds a forward chunk's logits only beyond
    chunk_rows x vocab / 128 rows (a million at V4's vocabulary and 1,024 chunk rows)."""
    cols = chunk_rows * vocab // max(rows, 1)
    return max(1, min(vocab, max(align, cols // align * align)))


def _logit_grad(hidden: Tensor, weight_slice: Tensor, col0: int, targets: Tensor, lse: Tensor,
                mean_l: Tensor, g_logp: Tensor | None, g_ent: Tensor | None,
                temperature: float) -> Tensor:
    """dL/dz (N, cols) for the vocabulary slice starting at `col0`, in the model dtype."""
    logits = _logits(hidden, weight_slice, temperature)
    probs = (logits - lse[:, None]).exp_()
    if g_ent is not None:  # d entropy / dl = -p (l - E_p[l]);  d logp / dl = onehot - p
        grad = logits.sub_(mean_l[:, None]).mul_(g_ent[:, None])
        if g_logp is not None:
            grad.add_(g_logp[:, None])
        grad.mul_(probs).neg_()
    else:
        del logits
        grad = probs.mul_(-g_logp[:, None])  # type: ignore[index]  # one of the two is set
    del probs
    if g_logp is not None:  # + g_logp at each row's target, where it falls in this slice
        cols = grad.shape[1]
        local = targets - col0
        hit = (local >= 0) & (local < cols)
        grad.scatter_add_(1, local.clamp(0, cols - 1)[:, None], (g_logp * hit)[:, None])
    if temperature != 1.0:
        grad.div_(temperature)
    return grad.to(hidden.dtype)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
                chunk_rows: int, entropy: bool) -> tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        logp, mean_l = torch.empty_like(lse), torch.zeros_like(lse)
        for r0 in range(0, n, chunk_rows):
            rows = slice(r0, min(n, r0 + chunk_rows))
            logits = _logits(hidden[rows], weight, temperature)
            lse[rows] = torch.logsumexp(logits, dim=-1)
            logp[rows] = logits.gather(1, targets[rows, None]).squeeze(1) - lse[rows]
            if entropy:
                probs = (logits - lse[rows, None]).exp_()
                mean_l[rows] = probs.mul_(logits).sum(dim=-1)  # E_p[l], in place: no third copy
                del probs
            del logits
        ent = lse - mean_l if entropy else torch.zeros_like(lse)
        ctx.save_for_backward(hidden, weight, targets, lse, mean_l)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: Tensor | None, g_ent: Tensor | None):
        hidden, weight, targets, lse, mean_l = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        if (g_logp is None and g_ent is None) or not (need_h or need_w):
            return None, None, None, None, None, None
        n, vocab = hidden.shape[0], weight.shape[0]
        cols = slice_columns(n, vocab, ctx.chunk_rows, SLICE_ALIGN if hidden.is_cuda else 1)
        grad_w = torch.empty_like(weight) if need_w else None
        grad_h = None
        acc = (torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
               if need_h and cols < vocab else None)
        for c0 in range(0, vocab, cols):
            w_slice = weight[c0:c0 + cols]
            grad = _logit_grad(hidden, w_slice, c0, targets, lse, mean_l, g_logp, g_ent,
                               ctx.temperature)
            if grad_w is not None:
                torch.mm(grad.t(), hidden, out=grad_w[c0:c0 + cols])
            if acc is not None:
                _accumulate(acc, grad, w_slice)
            elif need_h:
                grad_h = grad @ w_slice
            del grad
        if acc is not None:
            grad_h = acc.to(hidden.dtype)
        return grad_h, grad_w, None, None, None, None


def chunked_logprobs(hidden_BTH: Tensor, weight_VH: Tensor, targets_BT: Tensor,
                     temperature: float = 1.0, chunk_rows: int = DEFAULT_CHUNK_ROWS,
                     entropy: bool = False) -> tuple[Tensor, Tensor]:
    """(log-probs, entropies), both `(B, T)` float32, of `targets_BT` under
    softmax(hidden W^T / temperature); entropies are zeros unless `entropy`. Differentiable in
    `hidden_BTH` and `weight_VH` (see the module docstring for what is kept)."""
    if hidden_BTH.shape[:-1] != targets_BT.shape:
        raise ValueError(f"chunked_logprobs: hidden {tuple(hidden_BTH.shape)} do not match "
                         f"targets {tuple(targets_BT.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature: got {temperature!r}, expected a value > 0")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows: got {chunk_rows!r}, expected a value >= 1")
    hidden_NH = hidden_BTH.reshape(-1, hidden_BTH.shape[-1])
    targets_N = targets_BT.reshape(-1).long()
    logp, ent = _ChunkedLogprobs.apply(hidden_NH, weight_VH, targets_N, float(temperature),
                                       int(chunk_rows), bool(entropy))
    return logp.reshape(targets_BT.shape), ent.reshape(targets_BT.shape)


@dataclass(frozen=True, slots=True)
class _Request:
    targets_BT: Tensor
    temperature: float
    entropy: bool
    chunk_rows: int


class LogprobHead(torch.nn.Linear):
    """The model's `lm_head` (`nn.Linear`, same `weight` parameter: state dicts, tied embeddings
    and DeepSpeed's hooks are unchanged) that, inside `logprobs_of(targets)`, returns per-token
    `[log-prob, entropy]` pairs instead of logits: `(B, T, 2)` float32 for `targets_BT` of
    `(B, T)`, position t of the hidden states scoring targets[:, t] (the model's forward passes
    all L >= T positions; the last L - T are not scored). Outside the context it is `nn.Linear`."""

    _request: _Request | None = None

    @classmethod
    def install(cls, model: torch.nn.Module) -> LogprobHead:
        """Replace `model`'s output embedding (an `nn.Linear` without bias) by a LogprobHead
        sharing its weight; returns it (the existing one if already installed)."""
        old = model.get_output_embeddings()
        if isinstance(old, cls):
            return old
        if type(old) is not torch.nn.Linear or old.bias is not None:
            what = type(old).__name__ + (" with a bias" if type(old) is torch.nn.Linear else "")
            raise ValueError(f"trainer.chunked_lm_head: the model's output layer is {what}, "
                             "expected nn.Linear without bias (set trainer.chunked_lm_head: "
                             "false)")
        head = cls(old.in_features, old.out_features, bias=False, device="meta")
        head.weight = old.weight  # the same Parameter: tying and ZeRO-3 partitioning survive
        model.set_output_embeddings(head)
        return head

    @contextlib.contextmanager
    def logprobs_of(self, targets_BT: Tensor, *, temperature: float = 1.0,
                    entropy: bool = False, chunk_rows: int = DEFAULT_CHUNK_ROWS):
        """Within: the head's forward returns `(B, T, 2)` [log-prob, entropy] of `targets_BT`."""
        self._request = _Request(targets_BT, temperature, entropy, chunk_rows)
        try:
            yield
        finally:
            self._request = None

    def forward(self, hidden_BLH: Tensor) -> Tensor:
        req = self._request
        if req is None:
            return super().forward(hidden_BLH)
        num = req.targets_BT.shape[1]
        if hidden_BLH.shape[1] < num:
            raise ValueError(f"LogprobHead: {hidden_BLH.shape[1]} positions for {num} targets")
        logp, ent = chunked_logprobs(hidden_BLH[:, :num], self.weight, req.targets_BT,
                                     req.temperature, req.chunk_rows, req.entropy)
        return torch.stack((logp, ent), dim=-1)

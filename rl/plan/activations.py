"""Activation memory of one trainer micro-batch (forward + backward), estimated per token.

What is counted, per decoder layer and token, in bf16 elements: the tensors autograd keeps for
backward in the transformers forward (inputs of every matmul, norm (with its fp32 upcast) and
activation function; the routed experts' copies of each token's hidden state, top_k of them).
Fused kernels keep less, so this leans high. Attention itself is counted as O(tokens) (a fused /
SDPA kernel keeps the output and a log-sum-exp); an eager kernel's (heads x S x S) score matrix
is reported separately (`eager_scores_bytes`), because it depends on the sequence length, not
only on the token budget.

With activation checkpointing (one checkpoint per decoder layer, as transformers'
`gradient_checkpointing_enable` does) the forward keeps each layer's input and the backward
recomputes one layer at a time: `layers x input + one layer's activations`.

The LM head, T tokens, V vocabulary, H hidden, e bytes per element of the model dtype:
- chunked (`trainer.chunked_lm_head`, the default; `rl.trainer.lm_head`): one chunk of R =
  min(`trainer.lm_head_chunk_rows`, T) rows of fp32 logits and the fp32 exp / gradient made from
  them, 8 x R x V, plus the hidden states it keeps for backward, their gradient and the fp32
  accumulator and slice product of that gradient, T x H x (2e + 8):
  `8 R V + T H (2e + 8)` (`chunked_head_bytes`);
- full logits: the logits (T, V) in the model dtype, their fp32 copies that
  `losses.token_logprobs` upcasts chunk by chunk and autograd keeps, and the logits' gradient:
  (2e + 4) bytes per token and vocab entry (+4 with an entropy bonus, whose softmax also keeps an
  fp32 copy).
Neither counts the head weight's gradient (a parameter gradient, as before).
"""
from __future__ import annotations

from dataclasses import dataclass

from rl.plan.arch import Arch, field_of, v4_compress_rates

BF16 = 2


def _norm(width: int) -> int:
    return 3 * width  # input (bf16) + fp32 upcast (= 2 bf16 units) kept by HF's RMSNorm


def _mlp(arch: Arch, kind: str) -> int:
    c, src, h = arch.config, arch.source, arch.hidden
    if kind == "dense":
        return _norm(h) + h + 4 * field_of(c, src, "intermediate_size")  # gate, up, act, product
    inter = field_of(c, src, "moe_intermediate_size")
    shared = 0
    if arch.model_type == "deepseek_v3":
        shared = h + 4 * inter * c.get("n_shared_experts", 1)
    elif arch.model_type == "deepseek_v4":  # one shared MLP, as transformers builds it
        shared = h + 4 * inter
    router = 2 * 2 * arch.num_experts  # fp32 logits and probabilities
    return _norm(h) + h + router + arch.top_k * (h + 4 * inter) + shared


def _attention(arch: Arch, kind: str) -> int:
    c, src, h = arch.config, arch.source, arch.hidden
    heads = field_of(c, src, "num_attention_heads")
    if arch.model_type in ("qwen3", "qwen3_moe"):
        kv = field_of(c, src, "num_key_value_heads", default=heads)
        hd = field_of(c, src, "head_dim", default=h // heads)
        q, k = heads * hd, kv * hd
        # projections in, q/k/v out, q/k norms (fp32), rope, attention output
        return _norm(h) + h + (q + 2 * k) + 3 * (q + k) + (q + k) + 2 * q
    if arch.model_type == "deepseek_v3":
        q_lora = c.get("q_lora_rank") or 0
        kv_lora, rope = field_of(c, src, "kv_lora_rank"), field_of(c, src, "qk_rope_head_dim")
        nope, v = field_of(c, src, "qk_nope_head_dim"), field_of(c, src, "v_head_dim")
        return (_norm(h) + h + (q_lora + _norm(q_lora)) + 2 * heads * (nope + rope)
                + (kv_lora + rope) + _norm(kv_lora) + heads * (nope + v) + heads * (nope + rope)
                + 2 * heads * v)
    # deepseek_v4: two hyper-connections (fp32 flatten + norm of hc x H, collapse, mix), the
    # grouped-output attention on 64 x 512-wide heads, and the layer's compressor.
    hc = field_of(c, src, "hc_mult", default=4)
    hd, q_lora = field_of(c, src, "head_dim"), field_of(c, src, "q_lora_rank")
    groups, o_lora = field_of(c, src, "o_groups"), field_of(c, src, "o_lora_rank")
    hyper = 2 * (4 * hc * h + h + hc * h)
    attn = (_norm(h) + h + q_lora + _norm(q_lora) + 5 * heads * hd + 5 * hd + 2 * heads * hd
            + groups * o_lora)
    if kind == "compressed_sparse_attention":
        idx, idx_heads = field_of(c, src, "index_head_dim"), field_of(c, src, "index_n_heads")
        attn += 8 * hd + 8 * idx + 2 * idx_heads * idx
    elif kind == "heavily_compressed_attention":
        attn += 4 * hd
    return hyper + attn


def layer_input_width(arch: Arch) -> int:
    """Elements per token of one decoder layer's input (V4 carries hc_mult residual streams)."""
    if arch.model_type == "deepseek_v4":
        return field_of(arch.config, arch.source, "hc_mult", default=4) * arch.hidden
    return arch.hidden


def layer_widths(arch: Arch) -> list[int]:
    """Per layer: bf16 elements per token kept for backward without checkpointing."""
    return [_attention(arch, a) + _mlp(arch, m) for a, m in zip(arch.layer_types, arch.mlp_kinds)]


@dataclass(frozen=True, slots=True)
class Activations:
    """Bytes on one trainer GPU for one micro-batch of `tokens` tokens."""
    layers: float
    """Decoder layers (all of them, or checkpoints + one recomputed layer)."""
    logits: float
    """The LM head (see the module docstring: chunked or full logits)."""
    eager_scores: float
    """An eager attention kernel's score matrices at this sequence length (0 for fused/SDPA)."""

    @property
    def total(self) -> float:
        return self.layers + self.logits + self.eager_scores


def eager_scores_bytes(arch: Arch, seq_len: int, rows: int, elem_bytes: int = BF16) -> float:
    """One layer's eager attention scores: rows x heads x S x S_kv in the model dtype (kept for
    backward) plus the fp32 softmax they are made from. V4 attends over S + S/m entries (window +
    compressed); the sliding-window mask is applied to a full S x S matrix."""
    heads = field_of(arch.config, arch.source, "num_attention_heads")
    kv_len = seq_len
    if arch.model_type == "deepseek_v4":
        kv_len += seq_len // v4_min_rate(arch)
    return rows * heads * seq_len * kv_len * (elem_bytes + 4)


def v4_min_rate(arch: Arch) -> int:
    return min(v4_compress_rates(arch.config).values())


def chunked_head_bytes(tokens: int, hidden: int, vocab: int, chunk_rows: int,
                       elem_bytes: int = BF16) -> float:
    """The chunked LM head's working memory: `8 R V + T H (2e + 8)` (module docstring)."""
    return 8.0 * min(chunk_rows, tokens) * vocab + tokens * hidden * (2.0 * elem_bytes + 8)


def estimate(arch: Arch, tokens: int, seq_len: int, checkpointing: bool, eager: bool,
             entropy: bool, elem_bytes: int = BF16, head_chunk_rows: int = 0) -> Activations:
    """Activation bytes for a micro-batch of `tokens` tokens of sequences up to `seq_len`;
    `elem_bytes` 2 for bf16 training, 4 for fp32 (CPU) training; `head_chunk_rows` > 0: the
    chunked LM head with chunks of that many rows, 0: full logits."""
    widths = layer_widths(arch)
    if checkpointing:
        layers = tokens * elem_bytes * (arch.num_layers * layer_input_width(arch) + max(widths))
    else:
        layers = tokens * elem_bytes * sum(widths)
    if head_chunk_rows > 0:
        logits = chunked_head_bytes(tokens, arch.hidden, arch.vocab, head_chunk_rows, elem_bytes)
    else:  # logits + their gradient in the model dtype, the fp32 chunks autograd keeps
        logits = tokens * arch.vocab * (2 * elem_bytes + 4 + (4 if entropy else 0))
    scores = 0.0
    if eager:
        one = eager_scores_bytes(arch, seq_len, max(tokens // seq_len, 1), elem_bytes)
        scores = one if checkpointing else one * arch.num_layers
    return Activations(layers, logits, scores)

"""`LinearV4Attention`: DeepSeek-V4's attention block with O(S)-memory core attention.

A subclass of transformers' `DeepseekV4Attention` with the same parameters (checkpoints and
weight sync see no difference) whose `forward`, for a whole sequence without a KV cache
(training, scoring), replaces the compressor's (S x T) block bias, the indexer's
(S x heads x T) scores and eager's (heads x S x (S+T)) scores with `v4_attention` over query
blocks. With a cache (generation) it runs transformers' eager forward unchanged.

The query's norm and rope, and the output's inverse rope, each pass over a (tokens x heads x
head_dim) tensor, 1.2 GB in bf16 at V4-Flash dims and 18,432 tokens, and eagerly they make ~10
such passes forward and backward (fp32 copies, the rope slice's `cat`, its zero-filled slice
gradients, the output's transpose copy). `_q_prep` and `_out_unrope` hold each chain in one
function, compiled on CUDA (`rl.models.v4_layer.compiled`): same arithmetic, eager elsewhere.
"""
from __future__ import annotations

import torch

from transformers.masking_utils import eager_mask, sliding_window_causal_mask_function
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4Attention, DeepseekV4CSACompressor, apply_rotary_pos_emb)

from rl.models.v4_attention.compress import compressed_entries, indexer_topk
from rl.models.v4_attention.kernel import attention
from rl.models.v4_layer.compiled import Fused
from rl.models.varlen import row_bounds


def _q_prep_fn(q_THD, cos, sin, eps: float):
    # DeepseekV4UnweightedRMSNorm, then apply_rotary_pos_emb, token-major (cos / sin (T, r/2))
    q_THD = q_THD * torch.rsqrt(q_THD.float().square().mean(-1, keepdim=True) + eps).to(
        q_THD.dtype)
    return apply_rotary_pos_emb(q_THD, cos, sin)


def _out_unrope_fn(out_THD, cos, sin):
    # undo the rope V (= K) carried, at the query position (as eager does); (T, H * D) out
    return apply_rotary_pos_emb(out_THD, cos, -sin).flatten(1)


_q_prep = Fused(_q_prep_fn, token_args=3)
"""(q (T, H, D), cos, sin (T, rope_dim / 2), eps) -> q normed and roped, (T, H, D)."""
_out_unrope = Fused(_out_unrope_fn, token_args=3)
"""(out (T, H, D), cos, sin (T, rope_dim / 2)) -> (T, H * D), the rope undone."""


class LinearV4Attention(DeepseekV4Attention):

    def forward(self, hidden_states, position_embeddings, position_ids, attention_mask,
                past_key_values=None, **kwargs):
        if past_key_values is not None:
            mask = self._eager_mask(hidden_states, attention_mask)
            return super().forward(hidden_states, position_embeddings, position_ids, mask,
                                   past_key_values, **kwargs)
        if self.training and self.attention_dropout > 0:
            raise ValueError(f"attention_dropout={self.attention_dropout}: the linear-memory V4 "
                             "attention has no dropout (expected 0, as DeepSeek-V4 ships)")
        batch, seq_len = hidden_states.shape[:2]
        cos, sin = position_embeddings[self.rope_layer_type]
        # q and kv exactly as DeepseekV4Attention.forward builds them.
        q_residual = self.q_a_norm(self.q_a_proj(hidden_states))
        tokens = batch * seq_len
        cos_T, sin_T = (x.expand(batch, -1, -1).reshape(tokens, -1) for x in (cos, sin))
        q = _q_prep(self.q_b_proj(q_residual).view(tokens, -1, self.head_dim), cos_T, sin_T,
                    self.q_b_norm.eps)
        q = q.view(batch, seq_len, -1, self.head_dim).transpose(1, 2)  # (B, H, S, D)
        kv = self.kv_norm(self.kv_proj(hidden_states)).view(batch, seq_len, 1, self.head_dim)
        kv = apply_rotary_pos_emb(kv.transpose(1, 2), cos, sin).squeeze(1)  # (B, S, D)

        # Packed rows (`trainer.pack_sequences`, `rl.trainer.packing`): one sequence, each row's
        # compressor windows, indexer and core attention of its own tokens only.
        cu = kwargs.get("cu_seq_lens_q")
        if cu is not None and batch != 1:
            raise ValueError(f"packed V4 attention: batch {batch}, expected one sequence")
        spans = [(0, seq_len)] if cu is None else row_bounds(cu)
        valid = None if attention_mask is None or cu is not None else attention_mask.bool()
        outs = []
        for a, b in spans:
            h, pos = hidden_states[:, a:b], position_ids[:, a:b]
            comp = topk = thr = None
            if self.compressor is not None:
                csa = isinstance(self.compressor, DeepseekV4CSACompressor)
                comp = compressed_entries(self.compressor, h, overlap=csa)
                if csa:
                    topk = indexer_topk(self.compressor.indexer, h, q_residual[:, a:b], pos)
                else:
                    thr = ((pos + 1) // self.compressor.compress_rate).expand(batch, -1)
            outs.append(attention(q[:, :, a:b], kv[:, a:b], comp, topk, thr, valid, self.sinks,
                                  self.scaling, self.sliding_window))  # (B, H, n, D)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        # (B, S, H, D) storage from the Triton forward: a view, no copy
        out = _out_unrope(out.transpose(1, 2).reshape(tokens, -1, self.head_dim), cos_T, sin_T)
        grouped = out.view(batch, seq_len, self.config.o_groups, -1)
        return self.o_b_proj(self.o_a_proj(grouped).flatten(2)), None

    def _eager_mask(self, hidden_states, attention_mask):
        # The model built the small mask of `linear_v4_mask` (2-D padding or None); eager with a
        # cache at prefill needs the 4-D one transformers would have built.
        if attention_mask is not None and attention_mask.dim() == 4:
            return attention_mask
        batch, seq_len = hidden_states.shape[:2]
        return eager_mask(batch_size=batch, q_length=seq_len, kv_length=seq_len,
                          mask_function=sliding_window_causal_mask_function(self.sliding_window),
                          attention_mask=None if attention_mask is None else attention_mask.bool(),
                          dtype=hidden_states.dtype, device=hidden_states.device)

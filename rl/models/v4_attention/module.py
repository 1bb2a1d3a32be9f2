"""`LinearV4Attention`: DeepSeek-V4's attention block with O(S)-memory core attention.

A subclass of transformers' `DeepseekV4Attention` with the same parameters (checkpoints and
weight sync see no difference) whose `forward`, for a whole sequence without a KV cache
(training, scoring), replaces the compressor's (S x T) block bias, the indexer's
(S x heads x T) scores and eager's (heads x S x (S+T)) scores with `v4_attention` over query
blocks. With a cache (generation) it runs transformers' eager forward unchanged.
"""
from __future__ import annotations

import torch

from transformers.masking_utils import eager_mask, sliding_window_causal_mask_function
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4Attention, DeepseekV4CSACompressor, apply_rotary_pos_emb)

from rl.models.v4_attention.compress import compressed_entries, indexer_topk
from rl.models.v4_attention.kernel import attention
from rl.models.varlen import row_bounds


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
        q = self.q_b_proj(q_residual).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        q = apply_rotary_pos_emb(self.q_b_norm(q), cos, sin)
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
        # Undo the rope that V (= K) carried, at the query position (as eager does).
        out = apply_rotary_pos_emb(out, cos, -sin).transpose(1, 2)
        grouped = out.reshape(batch, seq_len, self.config.o_groups, -1)
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

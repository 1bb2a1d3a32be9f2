"""The DeepSeek-V4 modules `install` swaps in: transformers' classes with the same parameters
and a forward through `hyper` / `moe` (class swap, as `rl.models.v4_attention` does, so state
dicts, hooks and DeepSpeed's parameter bookkeeping are untouched).

Every submodule is still called as a module (routers, experts, norms, mixers), so forward hooks
see what they saw before: routing replay (`rl.models.routing` hooks the routers), transformers'
output recorders, and ZeRO-3, which gathers a module's parameters when it is called.
"""
from __future__ import annotations

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4DecoderLayer, DeepseekV4HyperConnection, DeepseekV4HyperHead, DeepseekV4MLP,
    DeepseekV4RMSNorm, DeepseekV4SparseMoeBlock)

from rl.models.v4_layer import hyper
from rl.models.v4_layer.moe import swiglu_pair


class FusedRMSNorm(DeepseekV4RMSNorm):
    """`rl.models.v4_precision.BoundaryRMSNorm` (fp32 inside, the input's dtype out) as one
    fused function."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        out = hyper.rms_norm(hidden_states.reshape(-1, shape[-1]), self.weight,
                             self.variance_epsilon)
        return out.view(shape)


class FusedHyperConnection(DeepseekV4HyperConnection):
    """Same outputs as transformers' mixer ((B, S, N) post, (B, S, N, N) comb, both fp32, and the
    collapsed (B, S, D) input of the block) from `hyper.hc_pre`."""

    def forward(self, hidden_streams: torch.Tensor):
        batch, seq_len, n, dim = hidden_streams.shape
        post, comb, collapsed = hyper.hc_pre(
            hidden_streams.reshape(-1, n, dim), self.fn, self.base, self.scale,
            self.input_norm.eps, self.hc_eps, self.hc_sinkhorn_iters)
        return (post.view(batch, seq_len, n), comb.view(batch, seq_len, n, n),
                collapsed.view(batch, seq_len, dim))


class FusedHyperHead(DeepseekV4HyperHead):

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, n, dim = x.shape
        out = hyper.hc_head(x.reshape(-1, n, dim), self.hc_fn, self.hc_base, self.hc_scale,
                            self.input_norm.eps, self.eps)
        return out.view(batch, seq_len, dim)


class FusedMLP(DeepseekV4MLP):
    """The shared expert with its clamped SwiGLU as one fused function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        act = swiglu_pair(gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1]),
                          self.limit)
        return self.down_proj(act.view(gate.shape))


class FusedMoeBlock(DeepseekV4SparseMoeBlock):
    """transformers' block (router, experts, shared expert); with `split_shared` it returns the
    routed and the shared outputs apart, for the decoder layer to add inside its mix."""

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None,
                split_shared: bool = False):
        batch, seq_len, hidden_dim = hidden_states.shape
        if self.is_hash:
            _, weights, indices = self.gate(hidden_states, input_ids)
        else:
            _, weights, indices = self.gate(hidden_states)
        routed = self.experts(hidden_states.view(-1, hidden_dim), indices, weights)
        routed = routed.view(batch, seq_len, hidden_dim)
        shared = self.shared_experts(hidden_states)
        return (routed, shared) if split_shared else routed + shared


def _mix(streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
         *outputs: torch.Tensor) -> torch.Tensor:
    # (B, S, N, D) streams <- hyper.hc_post on the flattened tokens
    batch, seq_len, n, dim = streams.shape
    flat = [o.reshape(-1, dim) for o in outputs]
    out = hyper.hc_post(streams.reshape(-1, n, dim), post.reshape(-1, n),
                        comb.reshape(-1, n, n), *flat)
    return out.view(batch, seq_len, n, dim)


class FusedDecoderLayer(DeepseekV4DecoderLayer):
    """transformers' decoder layer with each stream mix one `hyper.hc_post` (fp32, one rounding;
    see `hyper`) and the MoE's shared expert added inside the second one."""

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor:
        post, comb, collapsed = self.attn_hc(hidden_states)
        attn_output, _ = self.self_attn(self.input_layernorm(collapsed), **kwargs)
        hidden_states = _mix(hidden_states, post, comb, attn_output)
        post, comb, collapsed = self.ffn_hc(hidden_states)
        normed = self.post_attention_layernorm(collapsed)
        if isinstance(self.mlp, FusedMoeBlock):
            parts = self.mlp(normed, input_ids=input_ids, split_shared=True)
        else:
            parts = (self.mlp(normed, input_ids=input_ids),)
        return _mix(hidden_states, post, comb, *parts)

"""A hand-written Qwen3 / Qwen3-MoE decoder for the `native` engine: static KV cache, fused
decode kernels, optional block-FP8 linear weights.

Layout: a batch is left-padded to a common prompt width P; row b's tokens occupy cache slots
[start[b], P) and every decode step writes slot `pos` for all rows at once, so one device scalar
`pos` and the per-row `start` describe the whole cache state. Row b's rotary position at slot j
is j - start[b] (what HF computes from the attention mask). `decode_step` reads `pos` from a
device tensor and never syncs with the host, so it can be captured in a CUDA graph.

Numerics: norms, rotary and softmax in fp32; GEMMs in the model dtype (bf16 on GPU, fp32 on CPU)
with fp32 accumulation; FP8 weights are dequantised inside the GEMM (see `rl.rollout.native.kernels`).
Embeddings, LM head, router and norms stay in the model dtype. With `kv_fp8` the cache holds e4m3
K/V with per-token scales (`rl.rollout.native.kvcache`): decode reads them, prefill attends over
its own full-precision K/V.

Leaves out: sliding-window attention, attention biases, rope scaling (raise at build time).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rl.plan.kv import KV_FP8_SLOT_ALIGN
from rl.quant.fast_quant import QuantAct
from rl.quant.policy import KeepPolicy, as_policy
from rl.rollout.native import kernels as K
from rl.rollout.native.kvcache import KVCache
from rl.rollout.native.weights import LinearSlot, Target, resolve_name

SUPPORTED = ("qwen3", "qwen3_moe")
# Above this many rows an FP8 GEMM dequantises the weight and calls cuBLAS (prefill is
# compute-bound; the fused W8A16 kernel is built for skinny decode GEMMs).
_DEQUANT_ROWS = 1024


@dataclass(frozen=True, slots=True)
class Shape:
    vocab: int
    hidden: int
    layers: int
    nh: int
    nkv: int
    head_dim: int
    inter: int
    eps: float
    rope_theta: float
    tied: bool
    is_moe: tuple[bool, ...]
    num_experts: int = 0
    top_k: int = 0
    moe_inter: int = 0
    norm_topk_prob: bool = True

    @classmethod
    def from_hf_config(cls, c) -> Shape:
        if c.model_type not in SUPPORTED:
            raise ValueError(f"native engine: model_type {c.model_type!r} is not supported; "
                             f"expected one of {', '.join(SUPPORTED)}")
        rope = getattr(c, "rope_parameters", None) or {"rope_type": "default",
                                                       "rope_theta": getattr(c, "rope_theta", 1e6)}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"native engine: rope_type {rope.get('rope_type')!r} is not supported")
        if getattr(c, "use_sliding_window", False) or getattr(c, "attention_bias", False):
            raise ValueError("native engine: sliding-window attention and attention biases are "
                             "not supported")
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        if head_dim % 16 or head_dim & (head_dim - 1):
            raise ValueError(f"native engine: head_dim {head_dim} must be a power of two >= 16")
        experts = getattr(c, "num_experts", 0) if c.model_type == "qwen3_moe" else 0
        mlp_only = set(getattr(c, "mlp_only_layers", []) or [])
        step = getattr(c, "decoder_sparse_step", 1) or 1
        is_moe = tuple(experts > 0 and i not in mlp_only and (i + 1) % step == 0
                       for i in range(c.num_hidden_layers))
        return cls(vocab=c.vocab_size, hidden=c.hidden_size, layers=c.num_hidden_layers,
                   nh=c.num_attention_heads, nkv=c.num_key_value_heads, head_dim=head_dim,
                   inter=c.intermediate_size, eps=c.rms_norm_eps,
                   rope_theta=float(rope["rope_theta"]), tied=bool(c.tie_word_embeddings),
                   is_moe=is_moe, num_experts=experts,
                   top_k=getattr(c, "num_experts_per_tok", 0) if experts else 0,
                   moe_inter=getattr(c, "moe_intermediate_size", 0) if experts else 0,
                   norm_topk_prob=bool(getattr(c, "norm_topk_prob", True)))

    def num_params(self) -> int:
        attn = self.hidden * (self.nh + 2 * self.nkv) * self.head_dim + self.nh * self.head_dim * self.hidden
        dense = 3 * self.hidden * self.inter
        moe = self.num_experts * 3 * self.hidden * self.moe_inter + self.num_experts * self.hidden
        body = sum(attn + (moe if m else dense) for m in self.is_moe)
        return body + self.vocab * self.hidden * (1 if self.tied else 2)


def attention_settings(fp8_kv: bool) -> dict:
    """`decode_attention`'s keyword settings the engine uses for a cache dtype (single pass and
    split-K alike).

    FP8 KV cache: tiles of the KV_FP8_SLOT_ALIGN (128) slots KVCache pads each row to (the FP8
    kernel's slots fill the tensor cores' 64-row side), e4m3 products where the GPU has them.
    BF16 cache: the defaults.
    """
    return dict(block_l=KV_FP8_SLOT_ALIGN) if fp8_kv else {}


# Which W8A8 kernel a GEMM takes, from a sweep on an H200 (CUDA graphs, weights past L2;
# bench/results/fp8_gemm.md): ours (`kernels.w8a8_triton`: TMA-fed, pipelined, split-K for
# narrow outputs) at decode's row counts, cuBLAS's block-scaled GEMM beyond (prefill, scoring).
# Up to W8A8_TRITON_ROWS rows ours wins at every measured shape (64 rows: Qwen3-0.6B qkv 4.7 us
# vs cuBLAS 6.1, gate_up 4.9 vs 6.1; Qwen3-4B gate_up 17.0 vs 22.5, down 11.9 vs 29.3). Up to
# W8A8_PARTIAL_ROWS it still wins for narrow outputs (N <= K: o, down) split over K, when the
# RMSNorm after them sums the partials (`Partials`; 256 rows: 0.6B o 4.9 vs 8.8, 4B down 17.5
# vs 29.7); wide outputs (qkv, gate_up) fill the GPU with output tiles there and cuBLAS's is as
# fast or faster (4B gate_up 32.2 vs 29.7).
W8A8_TRITON_ROWS = 64
W8A8_PARTIAL_ROWS = 256


def w8a8_kernel(rows: int, n: int, k: int, partial: bool) -> str:
    """"triton" or "cublas": the W8A8 GEMM "auto" picks for `rows` x (n, k)^T, by the rule
    above; `partial`: the caller takes `kernels.Partials`."""
    ours = rows <= W8A8_TRITON_ROWS or (
        partial and rows <= W8A8_PARTIAL_ROWS and n <= k and K.w8a8_triton_splits(rows, n, k) > 1)
    return "triton" if ours else "cublas"


class NativeQwen3:
    """Weights, KV cache and forward passes. `impl`: "triton" (CUDA) or "torch" (anywhere)."""

    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype, fp8: bool,
                 keep: KeepPolicy | Sequence[str] | None, max_len: int, impl: str,
                 pow2: bool = False, kv_fp8: bool = False, decode_attention: str = "single"):
        self.s, self.device, self.dtype, self.impl, self.max_len = shape, device, dtype, impl, max_len
        self.decode_attention = decode_attention
        """`rollout.decode_attention`: auto, single or split (see `attention_splits`)."""
        self.fixed_splits: int | None = None
        """Benchmarks: this many context splits whatever `decode_attention` says (None: off)."""
        self.fp8_mma: tuple[bool, bool] | None = None
        """Tests: the FP8-cache attention's (QK, PV) e4m3 products (None: the kernel's choice)."""
        self.fp8_gemm = "auto"
        """FP8 weights' GEMM: "auto" = W8A8 where `kernels.w8a8_supported` (our Triton kernel
        up to `W8A8_TRITON_ROWS` rows, or `W8A8_PARTIAL_ROWS` for a split-K o / down at decode;
        else cuBLAS's), else W8A16; tests and benchmarks pin
        "cublas" or "triton" (W8A8 on that kernel) or "w8a16"."""
        self.fused_partials = True
        """Decode hands split-K partials of o / down to the RMSNorm after them (`linear`'s
        `partial`); benchmarks set False to measure the GEMM's own reduction instead."""
        self.fp8, self.kv_fp8 = fp8, kv_fp8
        self.routes: dict[int, torch.Tensor] = {}
        """MoE layer -> (T, top_k) expert ids of the last forward through it."""
        policy = as_policy(keep)
        s = shape
        self.tensors: dict[str, torch.Tensor] = {}
        self.linears: dict[str, LinearSlot] = {}

        def plain(key: str, *dims: int) -> None:
            self.tensors[key] = torch.zeros(*dims, dtype=dtype, device=device)

        def linear(key: str, hf_names: list[str], *dims: int) -> None:
            quant = fp8 and not any(policy.keeps(n) for n in hf_names)
            self.linears[key] = LinearSlot(dims, quant, dtype, device, pow2)

        plain("embed", s.vocab, s.hidden)
        if not s.tied:
            plain("lm_head", s.vocab, s.hidden)
        plain("final_norm", s.hidden)
        qkv_rows = (s.nh + 2 * s.nkv) * s.head_dim
        for i, moe in enumerate(s.is_moe):
            p, hf = f"layers.{i}.", f"model.layers.{i}."
            for key, dim in (("ln1", s.hidden), ("ln2", s.hidden), ("q_norm", s.head_dim),
                             ("k_norm", s.head_dim)):
                plain(p + key, dim)
            linear(p + "qkv", [hf + f"self_attn.{x}_proj.weight" for x in "qkv"], qkv_rows, s.hidden)
            linear(p + "o", [hf + "self_attn.o_proj.weight"], s.hidden, s.nh * s.head_dim)
            if moe:
                plain(p + "router", s.num_experts, s.hidden)
                linear(p + "experts_gate_up", [hf + "mlp.experts.gate_up_proj"],
                       s.num_experts, 2 * s.moe_inter, s.hidden)
                linear(p + "experts_down", [hf + "mlp.experts.down_proj"],
                       s.num_experts, s.hidden, s.moe_inter)
            else:
                linear(p + "gate_up", [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"],
                       2 * s.inter, s.hidden)
                linear(p + "down", [hf + "mlp.down_proj.weight"], s.hidden, s.inter)
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float64,
                                                   device=device) / s.head_dim))
        freqs = torch.arange(max_len, dtype=torch.float64, device=device)[:, None] * inv[None, :]
        self.cos, self.sin = freqs.cos().float().contiguous(), freqs.sin().float().contiguous()
        self.cache: KVCache | None = None
        self.cache_rows = 0
        self._targets: dict[str, Target] = {}

    # ---- weights -------------------------------------------------------------------------
    def target(self, name: str) -> Target:
        t = self._targets.get(name)
        if t is None:  # cached: every sync resolves the same few hundred names
            s = self.s
            t = self._targets[name] = resolve_name(name, s.nh, s.nkv, s.head_dim, s.inter,
                                                   s.moe_inter, list(s.is_moe), s.tied)
        return t

    @torch.no_grad()
    def set_weight(self, name: str, value) -> None:
        """Write one named tensor (or FP8 wire pair) into its slot, in place."""
        t = self.target(name)
        if t.linear:
            self.linears[t.key].set(t.expert, t.row0, value)
            return
        if isinstance(value, tuple):
            raise ValueError(f"{name}: got FP8 wire data for a tensor the engine keeps in "
                             f"{self.dtype} (the sender's keep list must cover it)")
        dst = self.tensors[t.key]
        if tuple(value.shape) != tuple(dst.shape):
            raise ValueError(f"weight {name}: got shape {tuple(value.shape)}, expected "
                             f"{tuple(dst.shape)}")
        dst.copy_(value)

    def byte_destination(self, name: str, dtype: str, shape: tuple[int, ...]
                         ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Flat uint8 views that a wire tensor's raw bytes can be copied into, or None.

        For an FP8 weight (uint8 on the wire): (weight rows, their block-scale rows), when the
        piece owns whole 128-row blocks of an FP8 slot. For anything else: (destination, None)
        when the engine stores it with the same dtype and shape. None: needs `set_weight`.
        """
        from rl.quant.block_fp8 import DEFAULT_BLOCK, num_blocks
        try:
            t = self.target(name)
        except KeyError:
            return None
        flat = lambda x: x.view(torch.uint8).reshape(-1)  # noqa: E731
        if not t.linear:
            dst = self.tensors[t.key]
            ok = str(dst.dtype).removeprefix("torch.") == dtype and tuple(dst.shape) == shape
            return (flat(dst), None) if ok else None
        slot = self.linears[t.key]
        if dtype == "uint8" and not slot.fp8:
            return None
        if dtype != "uint8" and (slot.fp8 or str(slot.w.dtype).removeprefix("torch.") != dtype):
            return None
        if len(slot.shape) == 3 and t.expert is None:
            if shape != slot.shape:
                return None
            return flat(slot.w), (flat(slot.scale) if slot.fp8 else None)
        w = slot.w if t.expert is None else slot.w[t.expert]
        rows = shape[0]
        if len(shape) != 2 or shape[1] != slot.k or t.row0 + rows > slot.n:
            return None
        if not slot.fp8:
            return flat(w[t.row0:t.row0 + rows]), None
        if t.row0 % DEFAULT_BLOCK or (rows % DEFAULT_BLOCK and t.row0 + rows != slot.n):
            return None
        sc = slot.scale if t.expert is None else slot.scale[t.expert]
        b0 = t.row0 // DEFAULT_BLOCK
        return flat(w[t.row0:t.row0 + rows]), flat(sc[b0:b0 + num_blocks(rows, DEFAULT_BLOCK)])

    def pending(self) -> list[str]:
        return [f"{k}[{e}]" for k, slot in self.linears.items() for e in slot.pending()]

    def weight_bytes(self) -> int:
        return (sum(t.numel() * t.element_size() for t in self.tensors.values())
                + sum(slot.nbytes() for slot in self.linears.values()))

    # ---- cache ---------------------------------------------------------------------------
    def ensure_cache(self, rows: int) -> bool:
        """Allocate the KV cache for `rows` sequences of `max_len`; True if (re)allocated."""
        if self.cache_rows >= rows:
            return False
        s = self.s
        self.cache = None  # free the old one first
        free = self._free_bytes()
        if free is not None and self.cache_bytes(rows) > free:
            raise ValueError(
                f"rollout.max_batch_size: a KV cache for {rows} sequences of max_model_len "
                f"{self.max_len} needs {self.cache_bytes(rows) / 2**30:.1f} GiB, "
                f"{free / 2**30:.1f} GiB are free: at most {self.max_cache_rows(free)} fit"
                + ("" if self.kv_fp8 else " (rollout.kv_cache_dtype: fp8 holds 1.98x)"))
        self.cache = KVCache(s.layers, rows, s.nkv, self.max_len, s.head_dim, self.dtype,
                             self.device, self.kv_fp8)
        self.cache_rows = rows
        return True

    def cache_bytes(self, rows: int) -> int:
        """Bytes of a cache for `rows` sequences of max_len (the planner's per-token formula)."""
        s = self.s
        per_token = KVCache.bytes_per_token(s.layers, s.nkv, s.head_dim,
                                            torch.finfo(self.dtype).bits // 8, self.kv_fp8)
        return rows * KVCache.slots(self.max_len, self.kv_fp8) * per_token

    def _free_bytes(self) -> int | None:
        """Device bytes a new allocation can take (None off CUDA: no check)."""
        if self.device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(self.device)
        return free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(
            self.device)

    def max_cache_rows(self, budget_bytes: float) -> int:
        """Sequences of max_len whose cache fits in `budget_bytes`."""
        return int(budget_bytes // self.cache_bytes(1))

    # ---- building blocks -----------------------------------------------------------------
    def w8a8(self, key: str) -> bool:
        """Whether linear `key` takes the W8A8 GEMM here, i.e. its input may come quantised
        (`rmsnorm` / `silu_mul` with quant=True)."""
        slot = self.linears[key]
        return (slot.fp8 and self.impl == "triton" and self.fp8_gemm != "w8a16"
                and K.w8a8_supported(*slot.w.shape, self.device))  # type: ignore[call-arg]  # lint baseline (issue 39)

    def linear(self, x: torch.Tensor | QuantAct, key: str, partial: bool = False
               ) -> torch.Tensor | K.Partials:
        """x @ W(key).T. `partial`: the caller sums a split-K product itself (it hands the
        result to `kernels.rmsnorm`), so our split-K W8A8 kernel may return `kernels.Partials`."""
        slot = self.linears[key]
        if not slot.fp8:
            return F.linear(x, slot.w)
        # W8A8 (activations in e4m3 1x128 blocks, a block-scaled FP8 GEMM) at every row count,
        # so that prefill, scoring and decode round alike: at Qwen3-0.6B's decode shapes on an
        # H200 it beats our W8A16 kernel everywhere (bench/results/fp8_gemm.md), and decode's
        # inputs mostly arrive quantised by the kernel that produced them.
        if isinstance(x, QuantAct) or self.w8a8(key):
            gemm = self.fp8_gemm
            partial = partial and self.fused_partials
            if gemm == "auto":
                gemm = w8a8_kernel(x.rows if isinstance(x, QuantAct) else x.shape[0],  # type: ignore[call-arg]  # lint baseline (issue 39)
                                   *slot.w.shape, partial)
            return K.w8a8_linear(x, slot.w, slot.scale, impl=self.impl, out_dtype=self.dtype,
                                 gemm=gemm, partial=partial)
        if self.impl == "triton" and x.shape[0] <= _DEQUANT_ROWS:
            return K.w8a16_linear(x, slot.w, slot.scale, impl="triton")
        if self.impl == "triton":
            return F.linear(x, slot.dequantized(self.dtype))
        return K.w8a16_linear(x, slot.w, slot.scale, impl="torch")

    def mlp(self, x: torch.Tensor, i: int, partial: bool = False) -> torch.Tensor | K.Partials:
        """x (T, H) -> (T, H): dense SwiGLU or top-k MoE. `partial`: as `linear`'s."""
        p = f"layers.{i}."
        if not self.s.is_moe[i]:
            act = K.silu_mul(self.linear(x, p + "gate_up"), self.impl, quant=self.w8a8(p + "down"))
            return self.linear(act, p + "down", partial)
        return self.moe(x, i)

    def moe(self, x: torch.Tensor, i: int) -> torch.Tensor:
        s, p = self.s, f"layers.{i}."
        t = x.shape[0]
        probs = F.linear(x, self.tensors[p + "router"]).float().softmax(-1)
        w_TK, e_TK = probs.topk(s.top_k, dim=-1)
        # Kept by reference (no copy, graph-safe): the engine reads it for routing replay.
        self.routes[i] = e_TK
        if s.norm_topk_prob:
            w_TK = w_TK / w_TK.sum(-1, keepdim=True)
        w_TK = w_TK.to(x.dtype)
        flat = e_TK.reshape(-1)
        order = torch.sort(flat, stable=True).indices               # rows grouped by expert
        counts = torch.zeros(s.num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
        offs = torch.zeros(s.num_experts + 1, dtype=torch.int32, device=x.device)
        offs[1:] = counts.cumsum(0)
        xs = x[order // s.top_k]
        gu, dn = self.linears[p + "experts_gate_up"], self.linears[p + "experts_down"]
        h = K.grouped_linear(xs, gu.w, gu.scale, offs, self.impl)
        y = K.grouped_linear(K.silu_mul(h, self.impl), dn.w, dn.scale, offs, self.impl)
        out = torch.empty_like(y)
        out[order] = y                                             # back to (token, k) order
        return (out.view(t, s.top_k, -1).float() * w_TK[..., None].float()).sum(1).to(x.dtype)

    # ---- forward passes ------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, start: torch.Tensor, write_cache: bool) -> torch.Tensor:
        """ids (B, P) left-padded, start (B,) first real slot -> final-normed hidden (B, P, H).

        With `write_cache`, k/v of every slot go to cache rows [0, B), slots [0, P).
        """
        s, impl = self.s, self.impl
        b, width = ids.shape
        slots = torch.arange(width, device=ids.device)
        causal = slots[None, :] <= slots[:, None]                            # (P, P) q x k
        valid_k = slots[None, :] >= start[:, None].long()                     # (B, P)
        # Pad queries attend to themselves only, so no row is all -inf (NaN-free pads).
        mask = (causal[None] & valid_k[:, None, :]) | torch.eye(width, dtype=torch.bool,
                                                                 device=ids.device)[None]
        x = F.embedding(ids, self.tensors["embed"]).reshape(b * width, s.hidden)
        resid = None
        for i in range(s.layers):
            p = f"layers.{i}."
            # the decode step's fused kernels (RMSNorm + residual + the W8A8 input's
            # quantisation; q/k norm + rotary in one pass), so prefill and decode round alike
            h, resid = K.rmsnorm(x, self.tensors[p + "ln1"], s.eps, resid, impl,
                                 quant=self.w8a8(p + "qkv"))
            q, k, v = K.qk_norm_rope_prefill(self.linear(h, p + "qkv"), self.tensors[p + "q_norm"],
                                             self.tensors[p + "k_norm"], self.cos, self.sin,
                                             start, width, s.nh, s.nkv, s.eps, impl)
            if write_cache:
                self.cache.write(i, k, v)  # type: ignore[union-attr]  # lint baseline (issue 39)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None],
                                               scale=s.head_dim ** -0.5, enable_gqa=True)
            a = a.transpose(1, 2).reshape(b * width, s.nh * s.head_dim)
            h, resid = K.rmsnorm(self.linear(a, p + "o"), self.tensors[p + "ln2"], s.eps, resid,
                                 impl, quant=not s.is_moe[i] and self.w8a8(p + "gate_up"))
            x = self.mlp(h, i)
        h, _ = K.rmsnorm(x, self.tensors["final_norm"], s.eps, resid, impl)
        return h.view(b, width, s.hidden)  # type: ignore[union-attr]  # lint baseline (issue 39)

    def logits(self, h: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """(..., H) -> (..., V) in fp32, or (fp32=False) as the head's GEMM writes them, in the
        model dtype: the same values (the fp32 copy is exact), half the bytes for a sampler
        that converts as it reads (`sampling.sample_tokens`)."""
        head = self.tensors["embed"] if self.s.tied else self.tensors["lm_head"]
        y = F.linear(h, head)
        return y.float() if fp32 else y

    def attention_splits(self, rows: int) -> int:
        """Context splits of the decode attention for a batch of `rows`: fixed per batch bucket
        (a captured graph keeps its grid), from the cache length, not the current position."""
        if self.fixed_splits is not None:
            return self.fixed_splits
        if self.decode_attention == "single":
            return 1
        n = K.decode_splits(rows, self.s.nkv, self.max_len)
        return max(n, 2) if self.decode_attention == "split" else n

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, start: torch.Tensor, pos: torch.Tensor,
                    fp32_logits: bool = True) -> torch.Tensor:
        """tokens (B,) at slot `pos` (int32 (1,), on device) -> logits (B, V), fp32 or in the
        model dtype (`logits`).

        Writes their k/v at slot `pos` of cache rows [0, B). No host sync: graph-capturable
        when impl is "triton".
        """
        s, impl = self.s, self.impl
        b = tokens.shape[0]
        splits = self.attention_splits(b)
        attn = attention_settings(self.cache.fp8)  # type: ignore[union-attr]  # lint baseline (issue 39)
        if self.cache.fp8 and self.fp8_mma is not None:  # type: ignore[union-attr]  # lint baseline (issue 39)
            attn["fp8_mma"] = self.fp8_mma
        x = F.embedding(tokens, self.tensors["embed"])
        resid = None
        for i in range(s.layers):
            p = f"layers.{i}."
            h, resid = K.rmsnorm(x, self.tensors[p + "ln1"], s.eps, resid, impl,
                                 quant=self.w8a8(p + "qkv"))
            qkv = self.linear(h, p + "qkv")
            kc, vc, ke, ve = self.cache.layer(i)  # type: ignore[union-attr]  # lint baseline (issue 39)
            q = K.qk_norm_rope_cache(qkv, self.tensors[p + "q_norm"], self.tensors[p + "k_norm"],
                                     self.cos, self.sin, start, pos, kc, vc, s.nh, s.nkv, s.eps,
                                     impl, ke, ve)
            quant = self.w8a8(p + "o")  # then the kernel hands over the o GEMM's FP8 input
            a = K.decode_attention(q, kc, vc, start, pos, s.head_dim ** -0.5, impl, k_exp=ke,
                                   v_exp=ve, splits=splits, quant_out=quant, **attn)
            # o and down feed RMSNorms, which sum a split-K GEMM's partials as they read them
            o = self.linear(a if quant else a.view(b, s.nh * s.head_dim), p + "o", partial=True)  # type: ignore[union-attr]  # lint baseline (issue 39)
            # a dense layer's norm feeds one W8A8 GEMM; an MoE layer's also feeds its router
            h, resid = K.rmsnorm(o, self.tensors[p + "ln2"], s.eps, resid, impl,
                                 quant=not s.is_moe[i] and self.w8a8(p + "gate_up"))
            x = self.mlp(h, i, partial=True)
        h, _ = K.rmsnorm(x, self.tensors["final_norm"], s.eps, resid, impl)
        return self.logits(h, fp32_logits)

"""The `native` rollout engine: our own Qwen3 / Qwen3-MoE decoder for GPUs without vLLM.

`rl.rollout.native.model` holds the weights (block FP8 with `rollout.quantization: fp8`), a static
KV cache and the forward passes; this module batches requests, replays decode steps from CUDA
graphs, samples, and takes weight updates from the sync protocol.

Generation: prompts (x `n` samples; greedy decodes once per prompt and copies) run in chunks of
`rollout.max_batch_size`, padded to a power-of-two batch bucket so one captured graph serves
every chunk of that size. A chunk is prefilled in one pass, then decoded in lock step; finished
rows keep decoding (their tokens are cut at the stop token afterwards) and the loop ends early
once every row has stopped (checked every `_STOP_CHECK` steps, the only host syncs).

Sampling: temperature, top-k, top-p, from one torch generator per call seeded with
`sampling.seed` (like the `hf` engine: draws depend on how prompts are batched). Log-probs are
the raw temperature-1 values of the decode logits (`rl.rollout.base`), no second scoring pass.

Runs on CPU too (torch reference kernels, no graphs, fp32): that is what the CPU tests cover.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable

import torch

from rl.config import RolloutConfig
from rl.rollout.base import (
    Sample, SamplingParams, check_score_args, check_token_lists, check_version, cut_at_stop,
    decode_response, has_tokenizer,
    read_eos_ids, resolve_device, resolve_dtype,
)
from rl.rollout.native.kernels import triton_available
from rl.rollout.native.model import NativeQwen3, Shape
from rl.rollout.native.sampling import sample_tokens
from rl.rollout.native.weights import IncompleteWeightsError
from rl.rollout.routing import routing_rows
from rl.models.routing import routing_dtype
from rl.rollout.weights import WeightReceiver, pair_wire, receive_stream

log = logging.getLogger(__name__)
_STOP_CHECK = 16


def _bucket(rows: int, cap: int) -> int:
    return min(1 << max(rows - 1, 0).bit_length(), cap) if rows <= cap else cap


class _Graph:
    """One captured decode step for a batch bucket, with its static inputs and output."""

    def __init__(self, model: NativeQwen3, rows: int, pool):
        dev = model.device
        self.tokens = torch.zeros(rows, dtype=torch.long, device=dev)
        self.start = torch.zeros(rows, dtype=torch.int32, device=dev)
        # Warm-up and capture write the last cache slot, which a real step always rewrites
        # before reading it.
        self.pos = torch.full((1,), model.max_len - 1, dtype=torch.int32, device=dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # compiles the Triton kernels outside the capture
            for _ in range(2):
                model.decode_step(self.tokens, self.start, self.pos, fp32_logits=False)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: an NCCL watchdog thread (weight-sync group) may poll events meanwhile.
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.logits = model.decode_step(self.tokens, self.start, self.pos, fp32_logits=False)
        self.routes = dict(model.routes)  # the graph's static outputs, rewritten by each replay

    def __call__(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.pos.fill_(pos)
        self.graph.replay()
        return self.logits


class NativeEngine(WeightReceiver):
    """Rollout engine around `NativeQwen3` in this process (see the module docstring)."""

    def __init__(self, model_dir: str | Path | None, cfg: RolloutConfig, *, dtype: str = "auto",
                 device: str = "auto", hf_config=None, score_batch_tokens: int = 16384):
        from rl.models.hf_classes import transformers_classes
        from rl.models.loading import model_type

        self.cfg = cfg
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.device = resolve_device(device)
        if self.device.type == "cuda":
            if self.device.index is None:  # generators and graphs need a concrete index
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(dtype, self.device)
        config = hf_config or transformers_classes(model_type(self.model_dir))[0].from_pretrained(  # type: ignore[arg-type]  # lint baseline (issue 39)
            str(self.model_dir), local_files_only=True)
        self.shape = Shape.from_hf_config(config)
        impl = "triton" if self.device.type == "cuda" and triton_available() else "torch"
        if self.device.type == "cuda" and impl == "torch":
            log.warning("native engine: triton is not importable; decoding with torch reference "
                        "kernels and without CUDA graphs (slow)")
        self.model = NativeQwen3(self.shape, self.device, self.dtype, cfg.quantization == "fp8",
                                 cfg.fp8_keep_bf16, cfg.max_model_len, impl, cfg.fp8_pow2_scales,
                                 kv_fp8=cfg.kv_cache_dtype == "fp8",
                                 decode_attention=cfg.decode_attention)
        self.use_graphs = cfg.cuda_graphs and impl == "triton"
        self.tokenizer = None
        self.eos_ids: list[int] = []
        if self.model_dir is not None:
            from rl.models.loading import load_tokenizer
            self.tokenizer = load_tokenizer(self.model_dir) if has_tokenizer(self.model_dir) else None
            self.eos_ids = read_eos_ids(self.model_dir)
        elif config.eos_token_id is not None:
            eos = config.eos_token_id
            self.eos_ids = sorted({int(e) for e in (eos if isinstance(eos, list) else [eos])})
        pad = self.tokenizer.pad_token_id if self.tokenizer is not None else None
        pad = pad if pad is not None else config.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.eos_ids or [0])[0])
        self.vocab_size = self.shape.vocab
        self.score_batch_tokens = score_batch_tokens
        self.weight_version = 0
        self._graphs: dict[int, _Graph] = {}
        self._pool = None
        self._jobs = None   # cached weight-sync copy lists (see _copy_jobs)
        if self.model_dir is not None:
            self._load_checkpoint(self.model_dir)

    @classmethod
    def from_config(cls, hf_config, cfg: RolloutConfig, *, dtype: str = "auto",
                    device: str = "auto") -> NativeEngine:
        """An engine with zero weights (they arrive through the sync): benchmarks and tests."""
        return cls(None, cfg, dtype=dtype, device=device, hf_config=hf_config)

    # ---- generation --------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams
                 ) -> list[list[Sample]]:
        check_token_lists("prompt_ids", prompt_ids, self.vocab_size)
        if not prompt_ids:
            return []
        longest = max(len(p) for p in prompt_ids) + sampling.max_new_tokens
        if longest > self.model.max_len:
            raise ValueError(f"prompt ({longest - sampling.max_new_tokens} tokens) + max_new_tokens "
                             f"({sampling.max_new_tokens}) exceeds rollout.max_model_len "
                             f"({self.model.max_len})")
        stop_ids = sorted(set(self.eos_ids) | set(sampling.stop_token_ids))
        stop_t = torch.tensor(stop_ids or [-1], dtype=torch.long, device=self.device)
        draws = 1 if sampling.greedy else sampling.n
        rows = [p for p in prompt_ids for _ in range(draws)]
        gen = None
        if not sampling.greedy:
            gen = torch.Generator(self.device).manual_seed(sampling.seed)
        out: list[tuple[list[int], list[float], torch.Tensor | None]] = []
        for c in range(0, len(rows), self.cfg.max_batch_size):
            out += self._generate_chunk(rows[c:c + self.cfg.max_batch_size], sampling, stop_t, gen)
        stop_set = set(stop_ids)
        groups = []
        for i, p in enumerate(prompt_ids):
            group = []
            for k in range(sampling.n):
                tokens, lps, routed = out[i * draws + (0 if sampling.greedy else k)]
                tokens, reason = cut_at_stop(tokens, stop_set)
                if routed is not None:
                    routed = routed[:routing_rows(len(p), len(tokens))].numpy().astype(
                        routing_dtype(self.shape.num_experts))
                group.append(Sample(prompt_ids=list(p), response_ids=tokens,
                                    text=self._decode(tokens, reason), logprobs=lps[:len(tokens)],
                                    finish_reason=reason, weight_version=self.weight_version,
                                    routing=routed))
            groups.append(group)
        return groups

    def _decoder(self, rows: int):
        model = self.model
        if self.use_graphs:
            if rows not in self._graphs:
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                self._graphs[rows] = _Graph(model, rows, self._pool)
            graph = self._graphs[rows]
            return graph, graph.start, lambda: graph.routes
        pos_t = torch.zeros(1, dtype=torch.int32, device=self.device)
        start = torch.zeros(rows, dtype=torch.int32, device=self.device)

        def step(tokens: torch.Tensor, pos: int) -> torch.Tensor:
            pos_t.fill_(pos)
            return model.decode_step(tokens, start, pos_t, fp32_logits=False)
        return step, start, lambda: model.routes

    def _generate_chunk(self, rows: list[list[int]], sp: SamplingParams, stop_t: torch.Tensor,
                        gen: torch.Generator | None) -> list[tuple[list[int], list[float], object]]:
        n = len(rows)
        bb = _bucket(n, self.cfg.max_batch_size)
        rows = rows + [rows[0]] * (bb - n)  # bucket padding: copies, ignored afterwards
        if self.model.ensure_cache(bb):
            # They point into the old cache. A fresh pool too: reusing the handle of a pool
            # whose graphs are all gone trips an allocator assert (seen on torch 2.11).
            self._graphs.clear()
            self._pool = None
        step, start, routes = self._decoder(bb)     # captured before prefill fills the cache
        width = max(len(r) for r in rows)
        ids = torch.full((bb, width), self.pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        start.copy_(torch.tensor([width - len(r) for r in rows], dtype=torch.int32))
        ids = ids.to(self.device)
        h = self.model.prefill(ids, start, write_cache=True)[:, -1]
        moe = [i for i in range(self.shape.layers) if self.shape.is_moe[i]]
        want = sp.return_routing and bool(moe)
        # Routing of the prompt (prefill) and of each decode step's input token (R - 1 of them).
        def rows_NK(r):
            return torch.stack([r[i] for i in moe], 1).view(bb, -1, len(moe), self.shape.top_k)
        pre = rows_NK(self.model.routes) if want else None
        dec = []
        tok, lp = sample_tokens(self.model.logits(h, fp32=False), sp, gen)
        toks = torch.empty(bb, sp.max_new_tokens, dtype=torch.long, device=self.device)
        lps = torch.empty(bb, sp.max_new_tokens, dtype=torch.float32, device=self.device)
        toks[:, 0], lps[:, 0] = tok, lp
        done = torch.isin(tok, stop_t)
        steps = sp.max_new_tokens
        for t in range(1, sp.max_new_tokens):
            tok, lp = sample_tokens(step(tok, width + t - 1), sp, gen)
            if want:
                dec.append(rows_NK(routes()).clone())
            toks[:, t], lps[:, t] = tok, lp
            done |= torch.isin(tok, stop_t)
            if t % _STOP_CHECK == 0 and bool(done[:n].all()):
                steps = t + 1
                break
        out = list(zip(toks[:n, :steps].tolist(), lps[:n, :steps].tolist()))
        if not want:
            return [(t, lp, None) for t, lp in out]
        dec_BSNK = torch.cat(dec, 1).cpu() if dec else pre[:, :0].cpu()  # type: ignore[index]  # lint baseline (issue 39)
        pre = pre.cpu()  # type: ignore[union-attr]  # lint baseline (issue 39)
        return [(t, lp, torch.cat([pre[i, width - len(rows[i]):], dec_BSNK[i, :steps - 1]]))
                for i, (t, lp) in enumerate(out)]

    def _decode(self, tokens: list[int], reason: str) -> str:
        return decode_response(self.tokenizer, tokens, reason)

    # ---- scoring -----------------------------------------------------------------------
    @torch.no_grad()
    def score(self, prompt_ids: list[list[int]], response_ids: list[list[int]]
              ) -> list[list[float]]:
        """Raw temperature-1 log-probs of each response token (one prefill pass per batch)."""
        check_score_args(prompt_ids, response_ids, self.vocab_size)
        out: list[list[float]] = [[] for _ in prompt_ids]
        todo = sorted((i for i, r in enumerate(response_ids) if r),
                      key=lambda i: len(prompt_ids[i]) + len(response_ids[i]))
        while todo:
            batch = [todo.pop(0)]
            while todo and (len(batch) + 1) * (len(prompt_ids[todo[0]]) + len(response_ids[todo[0]])
                                               ) <= self.score_batch_tokens:
                batch.append(todo.pop(0))
            for j, lp in zip(batch, self._score_batch([prompt_ids[j] for j in batch],
                                                      [response_ids[j] for j in batch])):
                out[j] = lp
        return out

    def _score_batch(self, prompts: list[list[int]], responses: list[list[int]]
                     ) -> list[list[float]]:
        seqs = [p + r for p, r in zip(prompts, responses)]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        start = torch.tensor([width - len(s) for s in seqs], dtype=torch.int32, device=self.device)
        h = self.model.prefill(ids.to(self.device), start, write_cache=False)
        out = []
        for i, (p, r) in enumerate(zip(prompts, responses)):
            first = int(start[i]) + len(p) - 1  # position predicting response token 0
            lp = torch.log_softmax(self.model.logits(h[i, first:first + len(r)]), dim=-1)
            target = torch.tensor(r, dtype=torch.long, device=lp.device)
            out.append(lp.gather(-1, target[:, None]).squeeze(-1).tolist())
        return out

    # ---- weights -----------------------------------------------------------------------
    def _load(self, named) -> int:
        count = 0
        for name, value in named:
            self.model.set_weight(name, value)
            count += 1
        pending = self.model.pending()
        if pending:
            raise IncompleteWeightsError(f"fused weights incomplete after loading (a layer must "
                                         f"arrive whole): {pending[:5]}")
        return count

    def _load_checkpoint(self, model_dir: Path) -> None:
        from safetensors import safe_open

        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"native engine: no *.safetensors in {model_dir}")

        def tensors():
            for f in files:
                with safe_open(str(f), framework="pt", device="cpu") as st:
                    for key in st.keys():
                        yield key, st.get_tensor(key).to(self.device)
        self._load(pair_wire(tensors()))

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
                     ) -> None:
        check_version(self.weight_version, version)
        self._load(pair_wire((n, t.to(self.device)) for n, t in named_tensors))
        self.weight_version = version

    def _load_received(self, group, plan, version: int, verify: bool) -> int:
        """Receive, place, and wait until the weights are usable on this device (the receive
        stats' `seconds` cover all of it).

        Every wire tensor the engine stores byte for byte (block-aligned FP8 pairs, same-dtype
        tensors) is copied straight from the bucket into its weight, all of a bucket's copies in
        one `torch._foreach_copy_`; the destinations are resolved once per plan, so a sync does
        little per-tensor Python work. The rest (quantise on receive, unaligned FP8 rows, dtype
        changes) goes through `set_weight` at the end.
        """
        from rl.sync.buckets import unpack_bucket
        from rl.sync.transport import receive_buckets

        if group.device != self.device:   # gloo to a GPU engine: the generic path
            count = self._load((n, tuple(x.to(self.device) for x in v) if isinstance(v, tuple)
                                else v.to(self.device))
                               for n, v in receive_stream(group, plan, version, verify, None))
        else:
            jobs = self._copy_jobs(plan)
            rest, count = [], 0
            for i, buf in enumerate(receive_buckets(group, plan, version, verify, raw=True)):
                dsts, spans, slow = jobs[i]
                if dsts:
                    torch._foreach_copy_(dsts, [buf[a:b] for a, b in spans])
                count += sum(1 for x in plan.buckets[i].slots  # tensors, a pair counts once
                             if x.name not in slow and not x.name.endswith("_scale_inv"))
                if slow:
                    rest += [(n, t) for n, t in unpack_bucket(plan.buckets[i], buf) if n in slow]
            count += self._load(pair_wire(rest))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return count

    def _copy_jobs(self, plan):
        """Per bucket: (destination byte views, (start, end) byte spans in the bucket, names of
        slots that need `set_weight`); cached per plan layout."""
        key = tuple((s.name, s.dtype, s.shape, s.offset) for b in plan.buckets for s in b.slots)
        if self._jobs is not None and self._jobs[0] == key:
            return self._jobs[1]
        jobs = []
        for bucket in plan.buckets:
            dsts, srcs, slow = [], [], set()
            by_name = {s.name: s for s in bucket.slots}
            for s in bucket.slots:
                if s.name.endswith("_scale_inv"):
                    continue  # placed with its weight
                scale = by_name.get(s.name + "_scale_inv") if s.dtype == "uint8" else None
                dest = self.model.byte_destination(s.name, s.dtype, s.shape)
                if dest is None or (dest[1] is None) != (scale is None):
                    slow.add(s.name)
                    if scale is not None:
                        slow.add(scale.name)
                    continue
                for dst, slot in ((dest[0], s), (dest[1], scale)):
                    if slot is not None:
                        if dst.numel() != slot.nbytes:
                            raise ValueError(f"{slot.name}: {slot.nbytes} bytes on the wire, "
                                             f"{dst.numel()} in the engine")
                        dsts.append(dst)
                        srcs.append((slot.offset, slot.offset + slot.nbytes))
            jobs.append((dsts, srcs, slow))
        self._jobs = (key, jobs)
        return jobs

    @property
    def num_sync_ranks(self) -> int:
        return 1

    def shutdown(self) -> None:
        self.close_weight_sync()
        self._graphs.clear()
        self._jobs = None


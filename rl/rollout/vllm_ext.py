"""Methods injected into every vLLM worker (`worker_extension_cls`), called by `collective_rpc`.

They run where the model lives (the engine process in-process, or each tensor-parallel worker
process), so the weight-sync group is built here too: bytes go straight from the broadcast into
the model, never through the engine's RPC channel.

Weights go through vLLM's in-place reload (`model_runner.reload_weights`, layerwise): every
layer is rebuilt from checkpoint-format tensors and re-processed (CPU GEMM weight packing, online
FP8 quantisation on GPU), which a plain `model.load_weights` cannot do once the weights were
packed (vLLM-CPU empties linear weights into oneDNN handles: `'Parameter' object has no
attribute 'weight_loader'`). One reload must receive whole layers: a layer that gets only some of
its tensors (q_proj without k_proj/v_proj) is processed with the rest uninitialised.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Iterable, Iterator

import torch

from rl.rollout.weights import WeightReceiver

log = logging.getLogger(__name__)


class _QuietRotaryReload(logging.Filter):
    """Drop vLLM's per-update "RotaryEmbedding: Failed to load weights" (DeepSeek-V4:
    "DeepseekV4ScalingRotaryEmbedding: ..."): its cos/sin cache is recomputed, never loaded, and
    the warning on every step reads like a broken sync."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args
                    and str(record.args[0]).endswith("RotaryEmbedding"))  # type: ignore[index]  # lint baseline (issue 39)


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
    _QuietRotaryReload())


# Checkpoint tensors that vLLM's DeepSeek-V4 loader (CPU, CUDA, ROCm and XPU alike) writes with
# a plain `params_dict[name][:n].copy_(...)` instead of the parameter's weight loader. Inside a
# layerwise reload that parameter is a meta tensor and nothing records the write, so the engine
# kept its old attention sinks after every update (no error). `_rl_reload` holds them back and
# loads them through `model.load_weights` once the reload has put the real tensors back.
_LOADED_PAST_RELOAD = re.compile(r"\.attn_sink$")


def _moe_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(checkpoint prefix, module) of every unquantized fused-MoE expert layer."""
    out = []
    for name, mod in model.named_modules():
        kernel = getattr(getattr(mod, "quant_method", None), "moe_kernel", None)
        if kernel is not None and hasattr(mod, "w13_weight"):
            out.append((name.removesuffix(".routed_experts"), mod))
    return out


def repack_cpu_moe(model: torch.nn.Module, loaded_names: set[str]) -> int:
    """Re-run the CPU expert weight packing that vLLM-CPU 0.32 skips on reload; returns layers.

    `UnquantizedFusedMoEMethod._setup_kernel` calls `fused_experts.process_weights_after_loading`
    (CPU: `cpu_prepack_moe_weight`) only on the first load, so after `reload_weights` the experts
    hold unpacked weights that the CPU kernel reads as packed: wrong outputs, no error. Only layers
    that received weights in this reload are repacked (repacking twice scrambles them). Names are
    matched as the model's own checkpoint mapper renames them: DeepSeek-V4 streams DeepSeek's
    names (`layers.N.ffn.experts.E.w1.weight`), which vLLM loads under `model.`; matched raw, no
    V4 layer was ever repacked.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        loaded_names = set(loaded_names) | set(mapper.apply_list(sorted(loaded_names)))
    count = 0
    for prefix, mod in _moe_layers(model):
        if any(n.startswith(prefix + ".") for n in loaded_names):
            mod.quant_method.moe_kernel.fused_experts.process_weights_after_loading(mod)
            count += 1
    return count


def _v4_cpu_compressors(model: torch.nn.Module) -> list[torch.nn.Module]:
    """vLLM-CPU's DeepSeek-V4 compressors (`DeepseekV4CPUCompressor`): the modules that keep an
    fp32 copy of their `norm.weight` for the CPU kernel."""
    return [m for m in model.modules() if callable(getattr(m, "cache_norm_weight_fp32", None))]


def drop_v4_cpu_norm_caches(model: torch.nn.Module) -> int:
    """Remove the DeepSeek-V4 CPU compressors' fp32 norm copies before an in-place reload;
    returns how many compressors held one.

    vLLM-CPU 0.32 makes that copy with `norm.weight.to(float32).contiguous()`, which in an fp32
    engine (the CPU default) is `norm.weight` itself, a Parameter, so the assignment registers
    `_norm_weight_fp32` as a second parameter of the compressor. vLLM's layerwise reload
    snapshots every registered parameter, rebuilds the layer from the parameters the model
    created (not that one), then copies each snapshot name back: `reload_weights` itself raised
    `AttributeError: 'DeepseekV4CPUCompressor' object has no attribute '_norm_weight_fp32'`.
    Without the copy the reload sees the compressor as built; `recache_v4_cpu_compressors`
    makes it again from the reloaded weights.
    """
    count = 0
    for mod in _v4_cpu_compressors(model):
        if hasattr(mod, "_norm_weight_fp32"):
            delattr(mod, "_norm_weight_fp32")  # a parameter, a buffer or a plain attribute
            count += 1
    return count


def recache_v4_cpu_compressors(model: torch.nn.Module) -> int:
    """Redo the DeepSeek-V4 CPU compressors' post-load step after an in-place reload; returns
    how many compressors it touched.

    `DeepseekV4CPUAttention.process_weights_after_loading` makes each compressor's fp32
    `_norm_weight_fp32`; `drop_v4_cpu_norm_caches` removed it before the reload, and the copy
    must hold the new `norm.weight`, so the compressors' own caching step
    (`cache_norm_weight_fp32`) runs again.
    """
    compressors = _v4_cpu_compressors(model)
    for mod in compressors:
        mod.cache_norm_weight_fp32()
    return len(compressors)


class WeightSyncExtension(WeightReceiver):
    """Mixed into vLLM's Worker: `self.model_runner`, `self.rank`, `self.device` are its own;
    the weight sync is `WeightReceiver`'s, behind the `rl_*` names `collective_rpc` calls."""
    model_runner: Any  # declared for the type checker only: the Worker sets them
    rank: int
    device: torch.device

    def _rl_reload(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        names: set[str] = set()
        held: list[tuple[str, torch.Tensor]] = []

        def recorded() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named:
                names.add(name)
                if _LOADED_PAST_RELOAD.search(name):
                    held.append((name, tensor.clone()))  # a view of a bucket that is reused
                else:
                    yield name, tensor

        model = self.model_runner.model
        drop_v4_cpu_norm_caches(model)
        self.model_runner.reload_weights(weights_iterator=recorded(), is_checkpoint_format=True)
        if held:
            with torch.no_grad():
                model.load_weights(iter(held))
        repacked = repack_cpu_moe(model, names)
        recached = recache_v4_cpu_compressors(model)
        log.debug("reloaded %d tensors (%d after the reload); repacked %d CPU MoE layers, "
                  "re-cached %d V4 compressors", len(names), len(held), repacked, recached)
        return len(names)

    def rl_load_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Load (checkpoint name, tensor) pairs; returns how many tensors were given."""
        return self._rl_reload(named)

    def rl_init_weight_sync(self, host: str, port: int, world_size: int, rank: int, backend: str,
                            timeout_s: float) -> None:
        """Join the sync group as rank `rank + self.rank` (tensor-parallel workers in order)."""
        self.init_weight_sync(host, port, world_size, rank + self.rank, backend, timeout_s)

    def rl_receive_weights(self, plan, version: int, verify: bool = False) -> dict:
        """Receive every bucket of `plan` and reload the model from them; returns stats."""
        return self.receive_weights(plan, version, verify)

    def _load_received(self, group, plan, version: int, verify: bool) -> int:
        from rl.rollout.weights import as_fp8_checkpoint, engine_loads_block_fp8, receive_stream

        if engine_loads_block_fp8(self.model_runner.vllm_config):
            # FP8 engine: the wire's e4m3 bytes and block scales are its checkpoint format
            stream = as_fp8_checkpoint(receive_stream(group, plan, version, verify, None))
        else:
            dtype = self.model_runner.model_config.dtype
            stream = receive_stream(group, plan, version, verify, dtype)
        return self._rl_reload(stream)

    def rl_close_weight_sync(self) -> None:
        self.close_weight_sync()

    def rl_weight_digest(self) -> float:
        """Sum of |w| over parameters (diagnostics: did anything change?)."""
        with torch.no_grad():
            return float(sum(p.detach().abs().sum().item()
                             for p in self.model_runner.model.parameters()))

    # ---- routing capture (algorithm.routing_replay) ------------------------------------------
    def rl_routing_capture(self, on: bool) -> list[int]:
        """Bind (or unbind) a capture callback on every MoE router; returns the MoE layer ids.

        vLLM's own `enable_return_routed_experts` needs Model Runner V2, which needs Triton, which
        vLLM-CPU does not have; the router's `set_capture_fn` hook it uses exists in V1 too."""
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        self._rl_routing: list[tuple[int, torch.Tensor]] = []
        layers = []
        for mod in self.model_runner.model.modules():
            if isinstance(mod, MoERunner) and isinstance(mod.router, BaseRouter):
                layer = mod.layer_id
                mod.router.set_capture_fn(
                    (lambda ids, _l=layer: self._rl_routing.append((_l, ids.to(torch.int32).cpu())))
                    if on else None)
                layers.append(layer)
        if on and not layers:
            raise RuntimeError("routing capture: the vLLM model has no MoE router to hook")
        return sorted(layers)

    def rl_routing_take(self) -> dict[int, torch.Tensor]:
        """Captured routing since the last take: layer id -> (tokens, top_k) int32, the rows of
        every forward in order."""
        per_layer: dict[int, list[torch.Tensor]] = {}
        for layer, ids in getattr(self, "_rl_routing", []):
            per_layer.setdefault(layer, []).append(ids)
        self._rl_routing = []
        return {k: torch.cat(v) for k, v in per_layer.items()}

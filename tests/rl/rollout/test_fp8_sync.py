"""Quantise-on-send: the trainer's `WeightSender` with `sync.wire_dtype: fp8`, received by the
native FP8 engine and the HF engine over gloo (the GPU test repeats this over NCCL)."""
import threading

import torch

from rl.cluster.groups import free_port
from rl.config import RolloutConfig, SyncConfig
from rl.quant.block_fp8 import dequantize_weight_block, quantize_weight_block
from rl.quant.wire import scale_name
from rl.trainer.weights import WeightSender


def test_fp8_plan_carries_bytes_and_scales_and_keeps_the_keep_list(hf_engine):
    sender = WeightSender(hf_engine.model, 0, True, SyncConfig(wire_dtype="fp8"),
                          torch.device("cpu"))
    slots = {s.name: s for b in sender.plan().buckets for s in b.slots}
    q = "model.layers.0.self_attn.q_proj.weight"
    assert slots[q].dtype == "uint8" and slots[scale_name(q)].dtype == "float32"
    assert slots[scale_name(q)].shape == (1, 1)
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    assert slots[experts].dtype == "uint8" and slots[scale_name(experts)].shape == (8, 2, 1)
    for kept in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight",
                 "model.norm.weight"):
        assert slots[kept].dtype == "float32" and scale_name(kept) not in slots
    native_bytes = WeightSender(hf_engine.model, 0, True, SyncConfig(), torch.device("cpu")
                                ).plan().total_bytes
    assert sender.plan().total_bytes < 0.6 * native_bytes
    full = sender.gather_all()  # full precision whatever the wire carries
    assert full[q].dtype == torch.float32 and scale_name(q) not in full


def test_fp8_send_to_native_and_hf_engines(model_dir, hf_engine):
    from rl.rollout.hf_engine import HFEngine
    from rl.rollout.native.engine import NativeEngine

    cfg = RolloutConfig(engine="native", max_model_len=64, quantization="fp8")
    native = NativeEngine(model_dir, cfg, dtype="float32", device="cpu")
    hf = HFEngine(model_dir, cfg, dtype="float32", device="cpu")
    with torch.no_grad():
        for p in hf_engine.model.parameters():
            p.mul_(1.1)  # something to send that differs from what both engines loaded
    sender = WeightSender(hf_engine.model, 0, True, SyncConfig(wire_dtype="fp8", bucket_mb=0.05),
                          torch.device("cpu"))
    plan = sender.plan()
    port = free_port()
    results, errors = {}, []

    def receive(name, engine, rank):
        try:
            engine.init_weight_sync("127.0.0.1", port, 3, rank, "gloo", 30.0)
            results[name] = engine.receive_weights(plan, version=1)
        except Exception as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=receive, args=a) for a in (("native", native, 1),
                                                                   ("hf", hf, 2))]
    for t in threads:
        t.start()
    sender.connect("127.0.0.1", port, 3)
    stats = sender.send(version=1)
    for t in threads:
        t.join(60)
    sender.close()
    native.shutdown()
    hf.shutdown()
    assert not errors, errors
    assert stats["bytes"] == plan.total_bytes <= results["native"]["bytes"]  # + alignment
    assert native.weight_version == hf.weight_version == 1
    w = hf_engine.model.model.layers[1].mlp.experts.down_proj.detach()
    deq = dequantize_weight_block(*quantize_weight_block(w), dtype=torch.float32)
    slot = native.model.linears["layers.1.experts_down"]
    assert torch.equal(slot.dequantized(torch.float32), deq)       # the sender's exact bytes
    assert torch.equal(hf.model.model.layers[1].mlp.experts.down_proj, deq)
    assert torch.equal(hf.model.lm_head.weight, hf_engine.model.lm_head.weight)  # kept in full

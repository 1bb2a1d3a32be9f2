"""NCCL weight sync GPU0 -> GPU1 with FP8 on the wire, into the native FP8 engine."""
import pytest
import torch

from tests.gpu.workers import two_gpus

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not two_gpus(), reason="needs 2 GPUs (nvidia-h200-x2)")]


def _check_engine_holds(sender, engine, report, tag: str) -> dict:
    """The engine's FP8 weights of layer 1 are the CPU reference quantisation of the sender's
    weights, bit for bit (bytes and scales), and within e4m3 block error of them."""
    from rl.quant.block_fp8 import quantize_weight_block

    pre = "model.layers.1."
    names = [pre + f"self_attn.{x}_proj.weight" for x in "qkvo"] + [
        pre + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    w = sender.call("weights", names).result()
    slots = {"qkv": [0, 1, 2], "o": [3], "gate_up": [4, 5], "down": [6]}
    worst, agree = 0.0, {}
    for key, parts in slots.items():
        full = torch.cat([w[names[i]] for i in parts])
        got_w = engine.call("slot", f"layers.1.{key}").result()
        got_s = engine.call("slot_scale", f"layers.1.{key}").result()
        # Every piece is block-aligned, so the fused slot is the pieces' blocks stacked.
        ref = [quantize_weight_block(w[names[i]]) for i in parts]
        ref_s = torch.cat([s for _, s in ref])
        ref_w = torch.cat([q.float() for q, _ in ref]) * ref_s.repeat_interleave(
            128, 0).repeat_interleave(128, 1)[:full.shape[0], :full.shape[1]]
        agree[key] = {"scales": (got_s == ref_s).float().mean().item(),
                      "values": (got_w == ref_w).float().mean().item()}
        if agree[key] != {"scales": 1.0, "values": 1.0}:
            report("sync_fp8_gpu_mismatch", tag=tag, slot=key, agree=agree[key])
        assert agree[key] == {"scales": 1.0, "values": 1.0}, (tag, key, agree)
        step = got_s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:full.shape[0],
                                                                           :full.shape[1]]
        # e4m3 block error: half an ulp (2^-4 relative) or half the subnormal step.
        assert ((got_w - full).abs() <= full.abs() * 2 ** -4 + step * 2 ** -10 + 1e-7).all()
        worst = max(worst, ((got_w - full).norm() / full.norm()).item())
    assert worst < 0.05
    return {"worst_rel_frobenius_err": worst}


@pytest.mark.parametrize("verify", [False, True])
def test_fp8_sync_delivers_the_senders_weights_bit_exact(model_dirs, report, verify):
    """Three updates: the first packs eagerly, the second captures the bucket packs in CUDA
    graphs (no ZeRO-3: the parameters never move) and the third replays them; the sender's
    weights change in place between updates, so a graph that packed stale or wrong data shows."""
    from rl.cluster.actors import ProcActor, wait_all
    from rl.cluster.groups import free_port
    from rl.config import RolloutConfig
    from tests.gpu.workers import EngineProbe, SenderWorker

    model_dir = str(model_dirs["dense"])
    sender = ProcActor(SenderWorker, model_dir, "cuda:0", "fp8", verify=verify, name="sender")
    cfg = RolloutConfig(engine="native", quantization="fp8", max_model_len=256)
    engine = ProcActor(EngineProbe, model_dir, cfg, dtype="bfloat16", device="cuda:1",
                       name="engine")
    try:
        wait_all([sender.ready, engine.ready], timeout=300)
        plan = sender.call("plan").result()
        port = free_port()
        wait_all([sender.call("connect", "127.0.0.1", port, 2),
                  engine.call("init_weight_sync", "127.0.0.1", port, 2, 1, "nccl", 120.0)],
                 timeout=180)
        for version in (1, 2, 3):
            if version > 1:
                sender.call("perturb", 100 + version).result()
            sent, got = wait_all([sender.call("send", version),
                                  engine.call("receive_weights", plan, version, verify)],
                                 timeout=180)
            assert got["weight_version"] == version and sent["bytes"] == plan.total_bytes
            stats = _check_engine_holds(sender, engine, report, f"v{version}")
            report("sync_fp8_gpu", verify=verify, version=version, buckets=len(plan.buckets),
                   bytes=plan.total_bytes, seconds=got["seconds"],
                   graphs=sender.call("uses_graphs").result(), **stats)
        assert sender.call("uses_graphs").result(), "the third update should replay CUDA graphs"
    finally:
        for a in (sender, engine):
            a.kill()

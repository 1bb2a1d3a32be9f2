"""NCCL weight sync GPU0 -> GPU1 with FP8 on the wire, into the native FP8 engine."""
import pytest
import torch

from tests.gpu.workers import two_gpus

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not two_gpus(), reason="needs 2 GPUs (nvidia-h200-x2)")]


@pytest.mark.parametrize("verify", [False, True])
def test_fp8_sync_delivers_the_senders_weights_within_block_error(model_dirs, report, verify):
    from rl.cluster.actors import ProcActor, wait_all
    from rl.cluster.groups import free_port
    from rl.config import RolloutConfig
    from rl.quant.block_fp8 import dequantize_weight_block, quantize_weight_block
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
        sent, got = wait_all([sender.call("send", 1),
                              engine.call("receive_weights", plan, 1, verify)], timeout=180)
        assert got["weight_version"] == 1 and sent["bytes"] == plan.total_bytes
        pre = "model.layers.1."
        names = [pre + f"self_attn.{x}_proj.weight" for x in "qkvo"] + [
            pre + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        w = sender.call("weights", names).result()
        slots = {"qkv": [0, 1, 2], "o": [3], "gate_up": [4, 5], "down": [6]}
        worst = 0.0
        agree = {}
        for key, parts in slots.items():
            full = torch.cat([w[names[i]] for i in parts])
            got_w = engine.call("slot", f"layers.1.{key}").result()
            # Every piece is block-aligned: the engine holds the sender's FP8 bytes, which are
            # the torch reference's (computed on the GPU, like the sender's) up to Triton's
            # last-bit fp32 division (one e4m3 step, < 1% of values; see kernel_cases).
            expect = [dequantize_weight_block(*quantize_weight_block(w[names[i]].cuda()),
                                              dtype=torch.float32).cpu() for i in parts]
            row = 0
            for i, e in zip(parts, expect):  # per piece, for the report
                agree[names[i].split(".")[-2]] = (got_w[row:row + len(e)] == e).float().mean().item()
                row += len(e)
            expect = torch.cat(expect)
            same = (got_w == expect).float().mean().item()
            if same <= 0.99:
                report("sync_fp8_gpu_mismatch", verify=verify, agree=agree, slot=key)
            assert same > 0.99, (key, same, agree)
            scale = engine.call("slot_scale", f"layers.1.{key}").result()
            step = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:full.shape[0],
                                                                               :full.shape[1]]
            # e4m3 block error: half an ulp (2^-4 relative) or half the subnormal step.
            assert ((got_w - full).abs() <= full.abs() * 2 ** -4 + step * 2 ** -10 + 1e-7).all()
            worst = max(worst, ((got_w - full).norm() / full.norm()).item())
        report("sync_fp8_gpu", verify=verify, buckets=len(plan.buckets), bytes=plan.total_bytes,
               seconds=got["seconds"], worst_rel_frobenius_err=worst, agree=agree)
        assert worst < 0.05
    finally:
        for a in (sender, engine):
            a.kill()

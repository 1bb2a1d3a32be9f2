"""Where `ExpertParallel(offload=True)` really keeps things, which a CPU run cannot show: after a
step the expert shards (bf16) are on the GPU, their fp32 master weights in pinned host memory,
the AdamW moments in host memory, and the shard equals its master rounded to bf16. One rank
(EP = 1: the placement does not depend on the split; tests/rl/trainer/test_expert_offload.py
checks the arithmetic with 2 ranks)."""
import pytest
import torch

pytestmark = pytest.mark.gpu


def test_offloaded_expert_state_lives_in_pinned_host_memory(model_dirs):
    import torch.distributed as dist

    from rl.cluster.groups import free_port
    from rl.models.loading import load_model
    from rl.trainer.expert_parallel import ExpertParallel, make_groups

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        dev = torch.device("cuda", torch.cuda.current_device())
        model = load_model(model_dirs["moe"], dtype=torch.bfloat16, device=dev)
        for p in model.parameters():
            p.requires_grad_(False)  # only the experts train
        ep = ExpertParallel(model, make_groups(1, 0, 1), dev, offload=True)
        ep.make_optimizer(1e-3, (0.9, 0.999), 0.0)
        ids = torch.randint(3, model.config.vocab_size, (2, 16), device=dev)
        model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        ep.reduce_grads(1)
        before = {n: p.detach().clone() for n, p in ep.params.items()}
        ep.step(1e-3, float(ep.grad_norm), clip=0.0)

        assert ep.optimizer.param_groups[0]["fused"]  # torch's fused AdamW, CPU kernel
        assert ep._grad32.is_pinned() and ep._stage.is_pinned()
        for name, p in ep.params.items():
            m, state = ep.master[name], ep.optimizer.state[ep.master[name]]
            assert p.device == dev and p.dtype == torch.bfloat16 and p.grad is None, name
            assert m.device.type == "cpu" and m.dtype == torch.float32 and m.is_pinned(), name
            assert state["exp_avg"].device.type == "cpu", name
            assert state["exp_avg_sq"].device.type == "cpu", name
            assert torch.equal(p.cpu(), m.detach().to(torch.bfloat16)), name
            assert not torch.equal(p, before[name]), name  # the step reached the device shard
    finally:
        dist.destroy_process_group()

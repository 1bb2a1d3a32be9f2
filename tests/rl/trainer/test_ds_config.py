from rl.config import TrainerConfig
from rl.trainer.worker import ds_config


def test_memory_settings_map_onto_deepspeed():
    base = ds_config(TrainerConfig(zero_stage=3, grad_clip=0.5), bf16=True)
    assert base["zero_optimization"]["stage"] == 3 and base["bf16"]["enabled"]
    assert base["gradient_clipping"] == 0.5
    assert "offload_optimizer" not in base["zero_optimization"]
    # Variable micro-batch counts: the caller owns the accumulation boundary.
    assert base["managed_gradient_accumulation"] is False
    nvme = ds_config(TrainerConfig(optimizer_offload="nvme", nvme_path="/nvme/x",
                                   param_offload="cpu"), False)
    assert nvme["zero_optimization"]["offload_optimizer"] == {
        "device": "nvme", "nvme_path": "/nvme/x", "pin_memory": True}
    assert nvme["zero_optimization"]["offload_param"]["device"] == "cpu"
    cpu = ds_config(TrainerConfig(optimizer_offload="cpu"), False)
    assert cpu["zero_optimization"]["offload_optimizer"]["device"] == "cpu"

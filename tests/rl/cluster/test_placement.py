"""Where the groups run (`rl.cluster.placement.place`, pure) and the weight-sync transport that
follows, for the machines a run meets: CPUs, one GPU, several, Ray or plain processes."""
import pytest

from rl.cluster.placement import Placement, choose_placement, place, sync_backend
from rl.config import Config, ConfigError, load_config


def cfg(*overrides) -> Config:
    return load_config(None, list(overrides)) if overrides else Config()


@pytest.mark.parametrize("ray, gpus, overrides, want, backend", [
    (False, 0, [], Placement("proc", "cpu", "cpu"), "gloo"),
    (True, 0, [], Placement("ray", "cpu", "cpu"), "gloo"),
    (False, 4, ["trainer.device=cpu"], Placement("proc", "cpu", "cpu"), "gloo"),
    # one GPU, the common first try: trainer and engine share it, CUDA IPC between them
    (False, 1, ["trainer.num_ranks=1"], Placement("proc", "cuda", "cuda"), "ipc"),
    # ... also where Ray is installed: Ray would want a GPU per actor and wait forever
    (True, 1, ["trainer.num_ranks=1"], Placement("proc", "cuda", "cuda"), "ipc"),
    # two GPUs, plain processes: the engine takes the one after the trainer ranks
    (False, 2, ["trainer.num_ranks=1"], Placement("proc", "cuda", "cuda:1"), "nccl"),
    # as many GPUs as trainer ranks: the engine shares GPU 0 with trainer rank 0
    (False, 2, ["trainer.num_ranks=2"], Placement("proc", "cuda", "cuda"), "ipc"),
    # Ray with enough GPUs: whole GPUs per actor
    (True, 2, ["trainer.num_ranks=1"], Placement("ray", "cuda", "cuda"), "nccl"),
    (True, 8, ["cluster.kind=slurm", "trainer.num_ranks=8"], Placement("ray", "cuda", "cuda"),
     "nccl"),
])
def test_placement_and_its_sync_backend(ray, gpus, overrides, want, backend):
    c = cfg(*overrides)
    got = place(c, ray=ray, num_gpus=gpus)
    assert got == want
    assert sync_backend(c, got) == backend


def test_ipc_is_refused_across_slurm_nodes_and_nccl_on_one_gpu():
    with pytest.raises(ConfigError, match="sync.backend: ipc shares memory within one machine"):
        sync_backend(cfg("cluster.kind=slurm", "sync.backend=ipc"),
                     Placement("ray", "cuda", "cuda"))
    one_gpu = cfg("trainer.num_ranks=1", "sync.backend=nccl")
    with pytest.raises(ConfigError, match="nccl would put trainer rank 0 and the rollout engine"):
        sync_backend(one_gpu, place(one_gpu, ray=False, num_gpus=1))
    # on a local Ray over CPUs shared memory works (one machine)
    assert sync_backend(cfg("sync.backend=ipc"), Placement("ray", "cpu", "cpu")) == "ipc"


def test_choose_placement_on_a_one_gpu_machine_puts_both_groups_on_it(monkeypatch):
    """What `bench.async_rl` and the runtime see on one H200, with or without Ray installed."""
    import torch

    import rl.cluster.placement as placement
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    c = cfg("trainer.num_ranks=1", "trainer.device=cuda")
    for ray in (False, True):
        monkeypatch.setattr(placement, "ray_installed", lambda ray=ray: ray)
        p = choose_placement(c)
        assert (p.backend, p.trainer_device, p.engine_device) == ("proc", "cuda", "cuda")
        assert sync_backend(c, p) == "ipc"


def test_more_local_trainer_ranks_than_gpus_is_refused():
    with pytest.raises(ConfigError, match=r"trainer\.num_ranks: got 2, but this machine has 1 "
                                          r"GPU\(s\).*; set trainer\.num_ranks=1, or trainer\.device=cpu"):
        place(cfg("trainer.num_ranks=2"), ray=False, num_gpus=1)
    # Slurm: the ranks span nodes, the driver's node alone says nothing about them
    assert place(cfg("cluster.kind=slurm", "trainer.num_ranks=2"), ray=True,
                 num_gpus=1) == Placement("ray", "cuda", "cuda")

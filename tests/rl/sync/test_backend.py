"""`sync.backend` -> the transport a placement allows (`rl.sync.backend.choose_backend`): a pure
function of the devices, so every layout is checked here without a GPU."""
import pytest

from rl.config import ConfigError
from rl.sync.backend import choose_backend


@pytest.mark.parametrize("trainer, engine, actors, same_host, want", [
    ("cpu", "cpu", "proc", True, "gloo"),
    ("cpu", "cpu", "ray", False, "gloo"),         # Slurm: rollout group on its own nodes
    ("cuda", "cuda", "proc", True, "ipc"),        # one GPU: the engine on rank 0's
    ("cuda:0", "cuda", "proc", True, "ipc"),
    ("cuda", "cuda:1", "proc", True, "nccl"),     # 2 GPUs, plain processes
    ("cuda", "cuda", "ray", True, "nccl"),        # Ray: each actor its own GPU
    ("cuda", "cuda", "ray", False, "nccl"),       # several nodes
    ("cuda", "cpu", "proc", True, "gloo"),        # one side on a CPU
])
def test_auto(trainer, engine, actors, same_host, want):
    assert choose_backend("auto", trainer, engine, actors=actors, same_host=same_host) == want


@pytest.mark.parametrize("backend", ["gloo", "nccl", "ipc"])
def test_an_explicit_backend_that_works_is_kept(backend):
    trainer, engine = {"gloo": ("cuda", "cuda"), "nccl": ("cuda", "cuda:1"),
                       "ipc": ("cuda", "cuda")}[backend]
    assert choose_backend(backend, trainer, engine) == backend
    assert choose_backend("gloo", "cuda", "cuda", actors="ray", same_host=False) == "gloo"
    assert choose_backend("ipc", "cpu", "cpu", actors="ray", same_host=True) == "ipc"


@pytest.mark.parametrize("backend, trainer, engine, actors, same_host, needles", [
    ("nccl", "cuda", "cuda", "proc", True,
     ["sync.backend: nccl", "same GPU", "duplicate GPU", "set sync.backend=auto (CUDA IPC here)"]),
    ("nccl", "cpu", "cpu", "proc", True, ["sync.backend: nccl needs", "gloo"]),
    ("ipc", "cuda", "cuda", "ray", False, ["sync.backend: ipc", "other nodes", "set sync.backend=auto"]),
    ("ipc", "cpu", "cpu", "ray", False, ["sync.backend: ipc", "other nodes"]),
    ("ipc", "cuda", "cuda:1", "proc", True, ["sync.backend: ipc needs the engines on trainer rank 0's "
                                             "device", "auto (nccl here)"]),
    ("ipc", "cuda", "cuda", "ray", True, ["each Ray actor with GPUs of its own"]),
    ("ipc", "cuda", "cpu", "proc", True, ["auto (gloo here)"]),
])
def test_impossible_choices_are_one_line_config_errors(backend, trainer, engine, actors,
                                                       same_host, needles):
    with pytest.raises(ConfigError) as err:
        choose_backend(backend, trainer, engine, actors=actors, same_host=same_host)
    message = str(err.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_an_engine_spanning_rank_0s_gpu_and_another_gets_gloo():
    # tensor parallel 2 on GPUs 0 and 1 with trainer rank 0 on GPU 0: one worker shares the GPU
    # (no NCCL), the other does not (no IPC)
    assert choose_backend("auto", "cuda", "cuda", engine_gpus=2) == "gloo"
    with pytest.raises(ConfigError, match="spanning 2 GPUs"):
        choose_backend("nccl", "cuda", "cuda", engine_gpus=2)
    assert choose_backend("auto", "cuda", "cuda:1", engine_gpus=2) == "nccl"

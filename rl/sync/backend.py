"""Which weight-sync transport a placement allows: `sync.backend` -> gloo, nccl or ipc.

A pure function of where trainer rank 0 (the sender) and the engines run, so the launcher can
refuse an impossible choice before anything starts (`launch.checks.check_placement_or_exit`, and
`rl.loop.run` before the SFT warm start), and the runtime hands both sides the same answer.

  both on CPUs                      auto -> gloo; ipc allowed on one host
  GPUs, engine on rank 0's GPU      auto -> ipc (CUDA IPC); nccl refused: NCCL takes no two ranks
                                    of one group on one GPU ("Duplicate GPU detected")
  GPUs, engine on other GPUs        auto -> nccl; ipc refused
  one side on a CPU                 auto -> gloo; nccl and ipc refused
  other nodes (Slurm's rollout      ipc refused: shared memory reaches one host only
    group)

Device strings are the placement's (`rl.cluster.placement.Placement`): `cpu`, `cuda`, `cuda:N`.
Plain processes see every GPU, and `cuda` is GPU 0 there (trainer rank 0 takes LOCAL_RANK 0, a
fresh engine process the current device, 0); Ray gives each GPU actor whole GPUs of its own, so
two Ray actors never share one.
"""
from __future__ import annotations

from rl.config import ConfigError

BACKENDS = ("auto", "gloo", "nccl", "ipc")


def _gpu_index(device: str) -> int | None:
    """None for a CPU; the GPU index of `cuda` / `cuda:N` (`cuda` alone: 0)."""
    kind, _, index = device.partition(":")
    if kind == "cpu":
        return None
    return int(index) if index else 0


def shares_gpu(trainer_device: str, engine_device: str, actors: str, same_host: bool) -> bool:
    """Whether the engine runs on trainer rank 0's GPU."""
    t, e = _gpu_index(trainer_device), _gpu_index(engine_device)
    return actors == "proc" and same_host and t is not None and t == e


def choose_backend(requested: str, trainer_device: str, engine_device: str, *,
                   actors: str = "proc", same_host: bool = True, engine_gpus: int = 1) -> str:
    """The transport for `sync.backend` = `requested` (see the module doc for the table).

    `actors`: `proc` (plain processes) or `ray`; `same_host`: trainer rank 0 and every engine on
    one machine; `engine_gpus`: GPUs one engine spans (its tensor-parallel size). Raises
    ConfigError, one line naming the key, the value and what to set instead, when `requested`
    cannot work there.
    """
    if requested not in BACKENDS:
        raise ConfigError(f"sync.backend: got {requested!r}, expected one of {', '.join(BACKENDS)}")
    gpus = _gpu_index(trainer_device) is not None and _gpu_index(engine_device) is not None
    cpus = _gpu_index(trainer_device) is None and _gpu_index(engine_device) is None
    shared = shares_gpu(trainer_device, engine_device, actors, same_host)
    where = f"trainer rank 0 on {trainer_device}, engines on {engine_device}"
    if shared and engine_gpus > 1:
        # Each engine worker is a rank: one shares rank 0's GPU (no NCCL), the others do not
        # (no IPC); only gloo takes both.
        if requested in ("nccl", "ipc"):
            raise ConfigError(
                f"sync.backend: {requested} cannot reach an engine spanning {engine_gpus} GPUs of "
                f"which one is trainer rank 0's ({where}); set sync.backend=auto (gloo here) or "
                "give the engines GPUs of their own")
        return "gloo"
    if requested == "auto":
        return "ipc" if shared else "nccl" if gpus else "gloo"
    if requested == "nccl":
        if shared:
            raise ConfigError(
                f"sync.backend: nccl would put trainer rank 0 and the rollout engine on the same "
                f"GPU ({where}) in one NCCL group, which NCCL refuses (duplicate GPU); set "
                "sync.backend=auto (CUDA IPC here) or ipc")
        if not gpus:
            raise ConfigError(f"sync.backend: nccl needs the trainer and the engines on GPUs "
                              f"({where}); set sync.backend=auto (gloo here) or gloo")
    if requested == "ipc":
        if not same_host:
            raise ConfigError(
                f"sync.backend: ipc shares memory within one machine, but the rollout engines "
                f"run on other nodes than trainer rank 0 ({where}); set sync.backend=auto "
                "(nccl on GPUs, gloo on CPUs)")
        if not (shared or cpus):
            raise ConfigError(
                f"sync.backend: ipc needs the engines on trainer rank 0's device ({where}"
                f"{', each Ray actor with GPUs of its own' if actors == 'ray' and gpus else ''}); "
                f"set sync.backend=auto ({'nccl' if gpus else 'gloo'} here)")
    return requested

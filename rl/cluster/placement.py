"""Where the two worker groups run, and the weight-sync transport that placement allows.

`place` is the pure decision (tests give it any GPU count); `choose_placement` feeds it what this
machine has. `sync_backend` maps a placement to `sync.backend`'s transport
(`rl.sync.backend.choose_backend`); `worker_env` / `worker_threads` are what each worker
process of a group starts with. `place` and `sync_backend` refuse what cannot work (ConfigError,
one line), which `launch.checks.check_placement_or_exit` and `rl.loop.run` turn into a refusal
before anything starts.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass

from rl.config import Config, ConfigError
from rl.sync.backend import choose_backend

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Placement:
    backend: str
    """`ray` or `proc`."""
    trainer_device: str
    engine_device: str


def place(cfg: Config, *, ray: bool, num_gpus: int) -> Placement:
    """`ray`: Ray is installed; `num_gpus`: the GPUs this machine shows (0 without CUDA).
    Raises ConfigError for a local GPU run with more trainer ranks than GPUs: the trainers' own
    NCCL group takes no two ranks on one GPU."""
    actors = "ray" if ray else "proc"
    if num_gpus == 0 or cfg.trainer.device == "cpu":
        return Placement(actors, "cpu", "cpu")
    if cfg.cluster.kind == "local" and num_gpus < cfg.trainer.num_ranks:
        raise ConfigError(f"trainer.num_ranks: got {cfg.trainer.num_ranks}, but this machine has "
                          f"{num_gpus} GPU(s) and every trainer rank needs one of its own (NCCL "
                          f"takes no two ranks of a group on one GPU); set trainer.num_ranks="
                          f"{num_gpus}, or trainer.device=cpu")
    needed = cfg.trainer.num_ranks + cfg.rollout.num_engines * cfg.rollout.tensor_parallel_size
    if ray and cfg.cluster.kind == "local" and num_gpus < needed:
        # Ray gives every actor whole GPUs of its own, so with fewer here its placement would
        # wait until cluster.placement_timeout_s. Plain processes can share them.
        actors = "proc"
    engine = "cuda"
    if actors == "proc" and num_gpus > cfg.trainer.num_ranks:
        # Plain processes see every GPU: the trainer ranks take the first ones (by LOCAL_RANK),
        # the engine the next (Ray instead gives each actor its own GPUs). Otherwise the engine
        # shares GPU 0 with trainer rank 0.
        engine = f"cuda:{cfg.trainer.num_ranks}"
    return Placement(actors, "cuda", engine)


def ray_installed() -> bool:
    return importlib.util.find_spec("ray") is not None


def choose_placement(cfg: Config) -> Placement:
    import torch
    ray = ray_installed()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    placement = place(cfg, ray=ray, num_gpus=gpus)
    if ray and placement.backend == "proc":
        log.info("%d GPU(s) here for %d trainer rank(s) and %d engine(s): the groups run as plain "
                 "processes sharing them (Ray would give each actor GPUs of its own)", gpus,
                 cfg.trainer.num_ranks, cfg.rollout.num_engines)
    return placement


def sync_backend(cfg: Config, placement: Placement) -> str:
    """The weight-sync transport (`gloo`, `nccl`, `ipc`) for `cfg.sync.backend` on `placement`;
    raises ConfigError (one line: key, value, what to set instead) when it cannot work there.

    Plain processes all run on this machine, and so does a local Ray; under Slurm the rollout
    group has nodes of its own (a heterogeneous job)."""
    same_host = placement.backend == "proc" or cfg.cluster.kind == "local"
    gpus = cfg.rollout.tensor_parallel_size if placement.engine_device != "cpu" else 1
    return choose_backend(cfg.sync.backend, placement.trainer_device, placement.engine_device,
                          actors=placement.backend, same_host=same_host, engine_gpus=gpus)


def worker_threads(cfg: Config, group: str) -> int:
    """torch / OpenMP threads of each process of `group` (trainer or rollout)."""
    rollout = cfg.rollout.torch_threads
    return rollout if group == "rollout" and rollout else cfg.trainer.torch_threads


def worker_env(cfg: Config, group: str) -> dict[str, str]:
    """The environment variables each worker process of `group` is started with."""
    env = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", ""),
           "OMP_NUM_THREADS": str(worker_threads(cfg, group)),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
           # fault-injection hooks (tests) reach the workers
           **{k: v for k, v in os.environ.items() if k.startswith("RL_FAULT_")}}
    return {k: v for k, v in env.items() if v}

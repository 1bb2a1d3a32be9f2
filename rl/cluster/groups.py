"""Placing the trainer group and the rollout group: Ray placement groups, or plain processes.

`make_layout` is the one pure function that decides who goes where; `start_groups` turns it into
actors. While a placement group waits, what is missing is logged every few seconds instead of
hanging silently.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass

from rl.cluster.actors import ProcActor, RayActor

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    name: str
    """`trainer` or `rollout`."""
    num_actors: int
    bundle: dict[str, float]
    """Resources per actor, e.g. {"CPU": 1, "GPU": 1, "trainer_node": 0.001}."""


def make_layout(num_trainers: int, num_engines: int, gpus_per_trainer: float, gpus_per_engine: float,
                cpus_per_actor: float = 1.0) -> tuple[GroupSpec, GroupSpec]:
    """Trainer bundles land only on nodes labelled `trainer_node`, engines on `rollout_node`.

    The labels are custom node resources of value 1 per node; each bundle asks a sliver of it, so
    many bundles share a node while never straying to the other group's nodes.
    """
    def bundle(label: str, gpus: float) -> dict[str, float]:
        b = {"CPU": cpus_per_actor, label: 0.001}
        if gpus:
            b["GPU"] = gpus
        return b
    return (GroupSpec("trainer", num_trainers, bundle("trainer_node", gpus_per_trainer)),
            GroupSpec("rollout", num_engines, bundle("rollout_node", gpus_per_engine)))


def _wait_placement(pg, spec: GroupSpec, timeout_s: float) -> None:
    import ray
    t0 = time.monotonic()
    ready = pg.ready()
    while True:
        done, _ = ray.wait([ready], timeout=5.0)
        if done:
            return
        waited = time.monotonic() - t0
        need = {k: v * spec.num_actors for k, v in spec.bundle.items()}
        log.warning("placement of the %s group (%d x %s) waiting %.0fs; cluster has %s available",
                    spec.name, spec.num_actors, spec.bundle, waited, ray.available_resources())
        if waited > timeout_s:
            raise TimeoutError(
                f"the {spec.name} group could not be placed within {timeout_s:.0f}s: it needs "
                f"{need} in {spec.num_actors} bundles, the cluster has {ray.cluster_resources()}")


def start_ray_group(spec: GroupSpec, cls, args_for, timeout_s: float, env: dict[str, str] | None = None
                    ) -> tuple[list[RayActor], object]:
    """Create one placement group for `spec` and one actor per bundle; `args_for(i)` gives
    (args, kwargs) of actor i."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = placement_group([dict(spec.bundle)] * spec.num_actors, strategy="PACK",
                         name=f"{spec.name}-{os.getpid()}")
    _wait_placement(pg, spec, timeout_s)
    remote_cls = ray.remote(cls)
    actors = []
    for i in range(spec.num_actors):
        args, kwargs = args_for(i)
        opts = dict(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=i),
            num_cpus=spec.bundle.get("CPU", 1), num_gpus=spec.bundle.get("GPU", 0),
            max_restarts=0, name=f"{spec.name}-{i}-{os.getpid()}",
            runtime_env={"env_vars": dict(env or {})})
        actors.append(RayActor(remote_cls.options(**opts).remote(*args, **kwargs), f"{spec.name}-{i}"))
    return actors, pg


def start_proc_group(spec: GroupSpec, cls, args_for, env: dict[str, str] | None = None) -> list[ProcActor]:
    actors = []
    for i in range(spec.num_actors):
        args, kwargs = args_for(i)
        actors.append(ProcActor(cls, *args, name=f"{spec.name}-{i}", env=env, **kwargs))
    return actors


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_ip() -> str:
    """This host's address as other nodes see it (Ray's view when Ray is up)."""
    try:
        import ray
        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"

"""Placing the trainer group and the rollout group: Ray placement groups, or plain processes.

`make_layout` is the one pure function that decides who goes where; `start_ray_group` (a Ray
placement group per worker group) or `start_proc_group` (plain processes) turns it into actors. While a placement group waits, what is missing is logged every few seconds instead of
hanging silently.
"""
from __future__ import annotations

import datetime
import logging
import os
import random
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from rl.cluster.actors import ProcActor, RayActor

log = logging.getLogger(__name__)

# The custom Ray node resources that pin each group to its own nodes (value 1 per node). Whoever
# starts Ray (job.run locally, slurm.ray_cluster in a job) labels the nodes with these.
TRAINER_NODE = "trainer_node"
ROLLOUT_NODE = "rollout_node"


@dataclass(frozen=True, slots=True)
class GroupSpec:
    name: str
    """`trainer` or `rollout`."""
    num_actors: int
    bundle: dict[str, float]
    """Resources per actor, e.g. {"CPU": 1, "GPU": 1, "trainer_node": 0.001}."""
    strategy: str = "PACK"
    """Ray placement strategy of the group's bundles (see `spread_strategy`)."""


def spread_strategy(num_actors: int, num_nodes: int) -> str:
    """One actor per node when there are exactly as many actors as nodes (STRICT_SPREAD: on CPU
    nothing else would stop PACK from stacking them on one node); otherwise PACK, which fills
    node after node and so keeps consecutive ranks together (GPU bundles force the spread)."""
    return "STRICT_SPREAD" if num_nodes > 1 and num_actors == num_nodes else "PACK"


def make_layout(num_trainers: int, num_engines: int, gpus_per_trainer: float,
                gpus_per_engine: float, cpus_per_actor: float = 1.0, trainer_nodes: int = 1,
                rollout_nodes: int = 1) -> tuple[GroupSpec, GroupSpec]:
    """Trainer bundles land only on nodes labelled `trainer_node`, engines on `rollout_node`.

    The labels are custom node resources of value 1 per node; each bundle asks a sliver of it, so
    many bundles share a node while never straying to the other group's nodes. `trainer_nodes` /
    `rollout_nodes`: how many nodes carry each label (1 for a local Ray).
    """
    def bundle(label: str, gpus: float) -> dict[str, float]:
        b = {"CPU": cpus_per_actor, label: 0.001}
        if gpus:
            b["GPU"] = gpus
        return b
    return (GroupSpec("trainer", num_trainers, bundle(TRAINER_NODE, gpus_per_trainer),
                      spread_strategy(num_trainers, trainer_nodes)),
            GroupSpec("rollout", num_engines, bundle(ROLLOUT_NODE, gpus_per_engine),
                      spread_strategy(num_engines, rollout_nodes)))


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


def start_ray_actor(pg, index: int, spec: GroupSpec, cls, args, kwargs, env: dict[str, str] | None,
                    name: str) -> RayActor:
    """One actor in bundle `index` of placement group `pg` (also used to replace a dead one)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    opts = dict(scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=index),
        num_cpus=spec.bundle.get("CPU", 1), num_gpus=spec.bundle.get("GPU", 0),
        max_restarts=0, name=name, runtime_env={"env_vars": dict(env or {})})
    return RayActor(ray.remote(cls).options(**opts).remote(*args, **kwargs), f"{spec.name}-{index}")


def start_ray_group(spec: GroupSpec, cls, args_for, timeout_s: float,
                    env: dict[str, str] | None = None, on_placed=None
                    ) -> tuple[list[RayActor], object]:
    """Create one placement group for `spec` and one actor per bundle; `args_for(i)` gives
    (args, kwargs) of actor i. `on_placed(pg)`, if given, runs once the group is placed and
    before any actor exists (e.g. to learn where bundle 0 landed)."""
    from ray.util.placement_group import placement_group

    pg = placement_group([dict(spec.bundle)] * spec.num_actors, strategy=spec.strategy,
                         name=f"{spec.name}-{os.getpid()}")
    _wait_placement(pg, spec, timeout_s)
    if on_placed is not None:
        on_placed(pg)
    actors = []
    for i in range(spec.num_actors):
        args, kwargs = args_for(i)
        actors.append(start_ray_actor(pg, i, spec, cls, args, kwargs, env, f"{spec.name}-{i}-{os.getpid()}"))
    return actors, pg


def _address_here() -> tuple[str, int]:
    return node_ip(), free_port()


def bundle_address(pg, bundle_index: int = 0) -> tuple[str, int]:
    """(IP of the node holding `bundle_index` of `pg`, a port free there now).

    Runs a tiny task inside the bundle: across nodes the trainers' rendezvous must be rank 0's
    node, which only Ray knows once the group is placed. The port is free when the task looks;
    rank 0 binds it moments later (the usual small race of picking a port in advance).
    """
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    task = ray.remote(_address_here).options(
        num_cpus=0.01, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle_index))
    return tuple(ray.get(task.remote()))


def bundle_nodes(pg) -> list[str]:
    """The node IP of every bundle of a placed group, in bundle order (from Ray's tables)."""
    import ray
    from ray.util.placement_group import placement_group_table

    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    by_bundle = placement_group_table(pg)["bundles_to_node_id"]
    return [ips.get(by_bundle[i], "?") for i in sorted(by_bundle)]


def start_proc_group(spec: GroupSpec, cls, args_for, env: dict[str, str] | None = None) -> list[ProcActor]:
    actors = []
    for i in range(spec.num_actors):
        args, kwargs = args_for(i)
        actors.append(ProcActor(cls, *args, name=f"{spec.name}-{i}", env=env, **kwargs))
    return actors


# Ports a rendezvous may take: above the kernel's ephemeral range (which bind(0) and every
# outgoing connection draw from) and above slurm/ray_cluster.py's Ray port blocks (20000-60000);
# Ray's own default worker ports are 10002-19999.
_RENDEZVOUS_FLOOR = 60001


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999                      # Linux's default


def free_port() -> int:
    """A port that is free now, for a rendezvous that binds it later (DeepSpeed's TCPStore, the
    sync's NCCL store). Drawn at random above the ephemeral range where there is room: bind(0)
    hands out an ephemeral port, and in the seconds until the store binds it any socket that
    Ray or gRPC opens can take the same one (EADDRINUSE at init_process_group, seen in CI).
    The draw is not the run's randomness (no effect on results), so it is not seeded."""
    lo = max(_ephemeral_range()[1] + 1, _RENDEZVOUS_FLOOR)
    if 65535 - lo >= 256:
        draw = random.SystemRandom()
        for _ in range(64):
            port = draw.randint(lo, 65535)
            with socket.socket() as s:
                try:
                    s.bind(("", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def tcp_store(host: str, port: int, world_size: int, is_master: bool,
              timeout: datetime.timedelta, wait_for_workers: bool = True):
    """A torch TCPStore (a rendezvous) whose server listens on `host` alone.

    torch's own server listens on every interface of the master (`*:port`), open to anyone who
    can reach the machine; handed a socket already bound to the job's address
    (`master_listen_fd`, which the libuv and the classic backends both take) it listens there
    only. The store owns that socket from then on. Clients connect as before."""
    import torch.distributed as dist
    fd = None
    if is_master:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(socket.SOMAXCONN)
        except BaseException:
            sock.close()
            raise
        fd = sock.detach()
    return dist.TCPStore(host, port, world_size, is_master, timeout,
                         wait_for_workers=wait_for_workers, master_listen_fd=fd)


def node_ip() -> str:
    """This host's address as other nodes see it (Ray's view when Ray is up)."""
    try:
        import ray
        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"

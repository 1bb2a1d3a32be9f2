"""The weight-sync group seen from the driver: trainer rank 0 (the sender) wired to every rollout
engine through the two facades (`rl.cluster.facades`), and one weight update over it.

`rl.runtime.Runtime` builds a `WeightSync` once its workers answer, and rebuilds the group
(`reconnect`) after it replaced a dead engine; `rl.publisher.WeightPublisher` sends each version.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from rl.cluster.actors import wait_all
from rl.sync.buckets import SyncPlan
from rl.sync.transport import SyncError

if TYPE_CHECKING:
    from rl.cluster.facades import RolloutGroup, TrainerGroup


def wait_for_sync(futures: list, timeout_s: float) -> list:
    """`wait_all` for a weight-sync step, where every failure short of a dead actor (ActorDied)
    is a SyncError, the type the recovery path catches: a worker's own SyncError arrives as one
    on both backends (`rl.cluster.actors`), and the driver giving up after `timeout_s` (a sender
    or receiver stuck mid-bucket) becomes one here."""
    try:  # in order, not failing fast: sender and receivers end (or time out) together
        return wait_all(futures, timeout_s, "weight sync", key="sync.timeout_s", fail_fast=False)
    except TimeoutError as e:
        raise SyncError(f"weight sync: not every trainer rank and engine finished within "
                        f"{timeout_s:.0f}s (one is stuck or waiting for a peer that stopped)") from e


class WeightSync:
    """The group joining trainer rank 0 (rank 0) with every engine, and the updates over it."""

    def __init__(self, trainer: TrainerGroup, rollout: RolloutGroup, backend: str,
                 timeout_s: float, local: bool):
        """`backend`: the transport (`rl.cluster.placement.sync_backend`); `timeout_s`:
        `sync.timeout_s`; `local`: a local cluster (`cluster.kind`), every peer on this host."""
        self.trainer, self.rollout = trainer, rollout
        self.backend, self.timeout_s, self.local = backend, timeout_s, local
        self.plan: SyncPlan = trainer.sync_plan()
        """The bucket layout every update sends (the trainer's, fixed for the run)."""

    def connect(self) -> None:
        """(Re)build the weight group: trainer rank 0 is rank 0; the engines follow, each taking
        as many ranks as it has workers (tensor parallel engines receive on every worker)."""
        host, port = self.trainer.sync_address()
        if self.backend == "ipc" or self.local:
            host = "127.0.0.1"  # every peer on this host: the store listens on loopback only
        sizes = self.rollout.num_sync_ranks()
        world = 1 + sum(sizes)
        futures = [self.trainer.init_weight_sync_async(host, port, world, self.backend)]
        futures += self.rollout.init_weight_sync_async(host, port, world, sizes, self.backend,
                                                       self.timeout_s)
        wait_for_sync(futures, self.timeout_s + 30)

    def reconnect(self, close_deadline_s: float) -> None:
        """A new group after an engine was replaced; `close_deadline_s`: rank 0 may first
        finish an update stuck on the dead engine."""
        self.trainer.close_weight_sync(close_deadline_s)
        self.connect()

    def update(self, version: int) -> dict:
        """Broadcast the trainer's weights to every engine; returns trainer-side stats."""
        futures = self.trainer.send_weights_async(version)
        futures += self.rollout.receive_weights_async(self.plan, version)
        return wait_for_sync(futures, self.timeout_s + 60)[0]

"""The two worker groups and the wiring between them.

`Runtime` starts N trainer ranks and M rollout engines (Ray actors, or plain processes where Ray
is absent) and hands the driver their typed facades (`runtime.trainer`, `runtime.rollout`:
`rl.cluster.facades`); it owns the weight-sync group joining trainer rank 0 with every engine,
the weight update itself, and fault handling for engines (a dead engine is restarted and
re-synced; the caller retries its work: `rl.publisher.WeightPublisher.retry`).
"""
from __future__ import annotations

import logging
import os
import time

import torch

from rl.cluster.actors import ActorDied, CallTimeout, wait_all  # noqa: F401 - re-exported
from rl.cluster.facades import Generation, RolloutGroup, TrainerGroup  # noqa: F401
from rl.cluster.groups import (GroupSpec, bundle_address, bundle_nodes, free_port, make_layout,
                               start_proc_group, start_ray_group)
from rl.cluster.placement import Placement, choose_placement, sync_backend  # noqa: F401
from rl.config import Config
from rl.rollout.base import SamplingParams
from rl.sync.transport import SyncError
from rl.trainer.worker import RankInfo, TrainerWorker

log = logging.getLogger(__name__)


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


class EngineHost:
    """Builds the configured engine inside the actor process and forwards the driver's calls."""

    def __init__(self, kind: str, model_dir: str, cfg, dtype: str, device: str, index: int,
                 verify: bool = False, torch_threads: int | None = None):
        from rl.rollout import create_engine
        from rl.signals import shield_worker
        shield_worker()
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.index, self.verify = index, verify
        self.engine = create_engine(kind, model_dir, cfg, dtype=dtype, device=device)
        self.busy_s = 0.0
        """Seconds spent generating, scoring and receiving weights (idle-ratio metrics)."""

    def _timed(self, fn, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - t0

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> dict:
        """{"groups": samples per prompt, "seconds": generation wall time in this engine}."""
        t0 = time.perf_counter()
        groups = self._timed(self.engine.generate, prompt_ids, sampling)
        return {"groups": groups, "seconds": time.perf_counter() - t0}

    def score(self, prompt_ids, response_ids):
        return self._timed(self.engine.score, prompt_ids, response_ids)

    def init_weight_sync(self, host, port, world_size, rank, backend, timeout_s):
        return self.engine.init_weight_sync(host, port, world_size, rank, backend, timeout_s)

    def receive_weights(self, plan, version: int) -> dict:
        return self._timed(self.engine.receive_weights, plan, version, verify=self.verify)

    def busy_seconds(self) -> float:
        return self.busy_s

    def num_sync_ranks(self) -> int:
        return getattr(self.engine, "num_sync_ranks", 1)

    def weight_version(self) -> int:
        return self.engine.weight_version

    def pid(self) -> int:
        return os.getpid()

    def threads(self) -> tuple[int, str | None]:
        """(torch's intra-op threads, OMP_NUM_THREADS) of this engine process."""
        return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")

    def shutdown(self) -> None:
        self.engine.shutdown()


class Runtime:
    def __init__(self, cfg: Config, model_dir: str, total_optimizer_steps: int,
                 placement: Placement | None = None):
        self.cfg, self.model_dir = cfg, model_dir
        self.placement = placement or choose_placement(cfg)
        self.sync_backend = sync_backend(cfg, self.placement)
        """The weight-sync transport (gloo, nccl or ipc); ConfigError here, before any worker
        starts, when `sync.backend` cannot work on this placement."""
        self.total_optimizer_steps = total_optimizer_steps
        gpus = 1 if self.placement.trainer_device == "cuda" else 0
        egpus = cfg.rollout.tensor_parallel_size if self.placement.engine_device != "cpu" else 0
        self.trainer_spec, self.rollout_spec = make_layout(
            cfg.trainer.num_ranks, cfg.rollout.num_engines, gpus, egpus,
            trainer_nodes=cfg.cluster.num_nodes("trainer"),
            rollout_nodes=cfg.cluster.num_nodes("rollout"))
        self._pgs: list = []  # placement groups (Ray only)
        self.restarts = 0
        self.abandoned = False
        """A generation was given up on (stop request): engines may still be busy with it."""
        t0 = time.perf_counter()
        # Several trainer nodes: the rendezvous is wherever rank 0 landed (else this machine).
        multi_node = cfg.cluster.num_nodes("trainer") > 1
        self.trainers, self.engines = [], []
        try:
            self.trainers = self._start(self.trainer_spec, TrainerWorker, self._trainer_args,
                                        on_placed=self._pick_master if multi_node else None)
            self.engines = self._start(self.rollout_spec, EngineHost, self._engine_args)
            self._log_placement()
            deadlines = cfg.cluster.deadlines
            wait_all([a.ready for a in self.trainers + self.engines if hasattr(a, "ready")],
                     deadlines.start_s, "starting the workers", key="cluster.deadlines.start_s")
            self.trainer = TrainerGroup(self.trainers, deadlines)
            self.rollout = RolloutGroup(self.engines, deadlines)
            wait_all(self.trainer.ping_async()
                     + [self.rollout.pid_async(i) for i in range(len(self.engines))],
                     deadlines.start_s, "starting the workers", key="cluster.deadlines.start_s")
            self.plan = self.trainer.sync_plan()
            self._connect_sync()
        except BaseException:
            # Nobody holds this half-built runtime to shut it down. Plain-process workers are
            # non-daemon: the ones that did start would wait on their pipes forever, and
            # multiprocessing joins them at exit, so the driver hung after printing its error.
            self._kill_all()
            raise
        log.info("runtime ready in %.1fs: %d trainer ranks, %d engines (%s), weight sync over %s",
                 time.perf_counter() - t0, len(self.trainers), len(self.engines),
                 self.placement.backend, self.sync_backend)

    # ---- construction --------------------------------------------------------------------
    def _pick_master(self, pg) -> None:
        """The DeepSpeed rendezvous: rank 0's node (bundle 0), which may be another machine."""
        self._master = bundle_address(pg, 0)

    def _trainer_args(self, i: int):
        if not hasattr(self, "_master"):  # plain processes: all on this machine
            self._master = ("127.0.0.1", free_port())
        info = RankInfo(rank=i, world_size=self.cfg.trainer.num_ranks,
                        master_addr=self._master[0], master_port=self._master[1])
        return ((self.cfg.trainer, self.cfg.algorithm, self.cfg.sync, self.model_dir,
                 self.cfg.model.dtype, info, self.cfg.seed, self.total_optimizer_steps), {})

    def _engine_args(self, i: int):
        dtype = "float32" if self.placement.engine_device == "cpu" else "bfloat16"
        return ((self.cfg.rollout.engine, self.model_dir, self.cfg.rollout, dtype,
                 self.placement.engine_device, i, self.cfg.sync.verify, self._threads("rollout")),
                {})

    def _threads(self, group: str) -> int:
        """torch / OpenMP threads of each process of `group` (trainer or rollout)."""
        rollout = self.cfg.rollout.torch_threads
        return rollout if group == "rollout" and rollout else self.cfg.trainer.torch_threads

    def _env(self, group: str) -> dict[str, str]:
        env = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", ""),
               "OMP_NUM_THREADS": str(self._threads(group)),
               "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
               # fault-injection hooks (tests) reach the workers
               **{k: v for k, v in os.environ.items() if k.startswith("RL_FAULT_")}}
        return {k: v for k, v in env.items() if v}

    def _start(self, spec: GroupSpec, cls, args_for, on_placed=None):
        env = self._env(spec.name)
        if self.placement.backend == "ray":
            actors, pg = start_ray_group(spec, cls, args_for,
                                         self.cfg.cluster.placement_timeout_s, env,
                                         on_placed=on_placed)
            self._pgs.append(pg)
            return actors
        return start_proc_group(spec, cls, args_for, env)

    def _log_placement(self) -> None:
        """Logs each actor's node: `placement: trainer-0@IP ... rollout-0@IP` (tests read it)."""
        if self.placement.backend != "ray":
            return
        names = []
        for spec, pg in zip((self.trainer_spec, self.rollout_spec), self._pgs):
            names += [f"{spec.name}-{i}@{ip}" for i, ip in enumerate(bundle_nodes(pg))]
        log.info("placement: %s (trainer rendezvous %s:%d)", " ".join(names), *self._master)

    def _connect_sync(self) -> None:
        """(Re)build the weight group: trainer rank 0 is rank 0; the engines follow, each taking
        as many ranks as it has workers (tensor parallel engines receive on every worker)."""
        host, port = self.trainer.sync_address()
        if self.sync_backend == "ipc" or self.cfg.cluster.kind == "local":
            host = "127.0.0.1"  # every peer on this host: the store listens on loopback only
        sizes = self.rollout.num_sync_ranks()
        world = 1 + sum(sizes)
        futures = [self.trainer.init_weight_sync_async(host, port, world, self.sync_backend)]
        futures += self.rollout.init_weight_sync_async(host, port, world, sizes,
                                                       self.sync_backend, self.cfg.sync.timeout_s)
        wait_for_sync(futures, self.cfg.sync.timeout_s + 30)

    # ---- the weight update ----------------------------------------------------------------
    def sync(self, version: int) -> dict:
        """Broadcast the trainer's weights to every engine; returns trainer-side stats."""
        futures = self.trainer.send_weights_async(version)
        futures += self.rollout.receive_weights_async(self.plan, version)
        return wait_for_sync(futures, self.cfg.sync.timeout_s + 60)[0]

    # ---- faults ----------------------------------------------------------------------------
    def _replace_engine(self, i: int):
        """A new engine i: in the rollout group's own bundle i under Ray (freed by the dead one)."""
        if self.placement.backend == "ray":
            from rl.cluster.groups import start_ray_actor
            args, kwargs = self._engine_args(i)
            new = start_ray_actor(self._pgs[1], i, self.rollout_spec, EngineHost, args, kwargs,
                                  self._env("rollout"),
                                  f"rollout-{i}-{os.getpid()}-{time.time_ns() % 10**9}")
            new.call("pid").result(timeout=self.cfg.cluster.placement_timeout_s)
            return new
        (new,) = start_proc_group(GroupSpec(self.rollout_spec.name, 1, self.rollout_spec.bundle),  # type: ignore[assignment]  # lint baseline (issue 39)
                                  EngineHost, lambda _k: self._engine_args(i), self._env("rollout"))
        wait_all([new.ready], self.cfg.cluster.deadlines.start_s, "restarting a rollout engine",  # type: ignore[attr-defined]  # lint baseline (issue 39)
                 key="cluster.deadlines.start_s")
        return new

    def restart_dead_engines(self, version: int) -> int:
        """Replace engines that no longer answer, rebuild the sync group, re-send `version`."""
        dead = []
        for i in range(len(self.engines)):
            try:
                self.rollout.pid_async(i).result(timeout=30)
            except Exception:  # noqa: BLE001 - any failure to answer means replace it
                dead.append(i)
        if not dead:
            return 0
        log.warning("rollout engines %s died; restarting and re-syncing weights v%d", dead, version)
        for i in dead:
            self.engines[i].kill()
            self.engines[i] = self._replace_engine(i)
        self.trainer.close_weight_sync(self.cfg.sync.timeout_s + 60
                                       + self.cfg.cluster.deadlines.call_s)
        self._connect_sync()
        self.sync(version)
        self.restarts += len(dead)
        return len(dead)

    def _kill_all(self) -> None:
        for a in self.engines + self.trainers:
            try:
                a.kill()
            except Exception:  # noqa: BLE001 - best effort, the error being raised matters more
                pass
        self._remove_pgs()

    def _remove_pgs(self) -> None:
        if self._pgs:
            from ray.util.placement_group import remove_placement_group
            for pg in self._pgs:
                remove_placement_group(pg)
            self._pgs = []

    def shutdown(self, failed: bool = False) -> None:
        """Ends every worker: politely (each frees its engine, process groups) unless the run
        `failed`; then they are killed at once, since a rank may hang in a collective with one
        that died and would keep its polite shutdown waiting."""
        if failed:
            self._kill_all()
            return
        for a in self.engines + self.trainers:
            if self.abandoned and a in self.engines:
                a.kill()  # still generating what the driver gave up on: no polite shutdown
                continue
            try:
                a.call("shutdown").result(timeout=30)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
            if hasattr(a, "close"):
                a.close()
            else:
                a.kill()
        self._remove_pgs()


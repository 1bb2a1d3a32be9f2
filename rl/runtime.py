"""The two worker groups: start, placement, restart and shutdown.

`Runtime` starts N trainer ranks and M rollout engines (`rl.rollout.host.EngineHost`; Ray actors,
or plain processes where Ray is absent) and hands the driver their typed facades
(`runtime.trainer`, `runtime.rollout`: `rl.cluster.facades`) and the weight-sync group joining
them (`runtime.weight_sync`: `rl.sync.group.WeightSync`). A dead engine is restarted and
re-synced (`restart_dead_engines`); the caller retries its work (`rl.publisher.WeightPublisher`).
"""
from __future__ import annotations

import logging
import os
import time

from rl.cluster.actors import wait_all
from rl.cluster.facades import RolloutGroup, TrainerGroup
from rl.cluster.groups import (GroupSpec, bundle_address, bundle_nodes, free_port, make_layout,
                               start_proc_group, start_ray_actor, start_ray_group)
from rl.cluster.placement import (Placement, choose_placement, sync_backend, worker_env,
                                  worker_threads)
from rl.config import Config
from rl.rollout.host import EngineHost
from rl.sync.group import WeightSync
from rl.trainer.worker import RankInfo, TrainerWorker

log = logging.getLogger(__name__)


class Runtime:
    trainer: TrainerGroup
    rollout: RolloutGroup  # owns the engine handles; a restart replaces one in place
    weight_sync: WeightSync

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
        self._abandoned = False
        t0 = time.perf_counter()
        # Several trainer nodes: the rendezvous is wherever rank 0 landed (else this machine).
        multi_node = cfg.cluster.num_nodes("trainer") > 1
        trainers, engines = [], []
        try:
            trainers = self._start(self.trainer_spec, TrainerWorker, self._trainer_args,
                                   on_placed=self._pick_master if multi_node else None)
            engines = self._start(self.rollout_spec, EngineHost, self._engine_args)
            self._log_placement()
            deadlines = cfg.cluster.deadlines
            wait_all([a.ready for a in trainers + engines if hasattr(a, "ready")],
                     deadlines.start_s, "starting the workers", key="cluster.deadlines.start_s")
            self.trainer = TrainerGroup(trainers, deadlines)
            self.rollout = RolloutGroup(engines, deadlines)
            wait_all(self.trainer.ping_async()
                     + [self.rollout.pid_async(i) for i in range(len(engines))],
                     deadlines.start_s, "starting the workers", key="cluster.deadlines.start_s")
            self.weight_sync = WeightSync(self.trainer, self.rollout, self.sync_backend,
                                          cfg.sync.timeout_s, local=cfg.cluster.kind == "local")
            self.weight_sync.connect()
        except BaseException:
            # Nobody holds this half-built runtime to shut it down. Plain-process workers are
            # non-daemon: the ones that did start would wait on their pipes forever, and
            # multiprocessing joins them at exit, so the driver hung after printing its error.
            self._kill(engines + trainers)
            raise
        log.info("runtime ready in %.1fs: %d trainer ranks, %d engines (%s), weight sync over %s",
                 time.perf_counter() - t0, len(trainers), len(engines),
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
                 self.placement.engine_device, i, self.cfg.sync.verify,
                 worker_threads(self.cfg, "rollout")), {})

    def _start(self, spec: GroupSpec, cls, args_for, on_placed=None):
        env = worker_env(self.cfg, spec.name)
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

    # ---- faults ----------------------------------------------------------------------------
    def _replace_engine(self, i: int):
        """A new engine i: in the rollout group's own bundle i under Ray (freed by the dead one)."""
        args, kwargs = self._engine_args(i)
        env = worker_env(self.cfg, "rollout")
        if self.placement.backend == "ray":
            new = start_ray_actor(self._pgs[1], i, self.rollout_spec, EngineHost, args, kwargs, env,
                                  f"rollout-{i}-{os.getpid()}-{time.time_ns() % 10**9}")
            new.call("pid").result(timeout=self.cfg.cluster.placement_timeout_s)
            return new
        (proc,) = start_proc_group(GroupSpec(self.rollout_spec.name, 1, self.rollout_spec.bundle),
                                   EngineHost, lambda _k: (args, kwargs), env)
        wait_all([proc.ready], self.cfg.cluster.deadlines.start_s, "restarting a rollout engine",
                 key="cluster.deadlines.start_s")
        return proc

    def restart_dead_engines(self, version: int) -> int:
        """Replace engines that no longer answer, rebuild the sync group, re-send `version`."""
        dead = self.rollout.dead(timeout_s=30)
        if not dead:
            return 0
        log.warning("rollout engines %s died; restarting and re-syncing weights v%d", dead, version)
        for i in dead:
            self.kill_engine(i)
            self.rollout.replace(i, self._replace_engine(i))
        self.weight_sync.reconnect(self.cfg.sync.timeout_s + 60
                                   + self.cfg.cluster.deadlines.call_s)
        self.weight_sync.update(version)
        self.restarts += len(dead)
        return len(dead)

    def kill_engine(self, i: int) -> None:
        """Kill rollout engine i at once (a restart, or fault injection: `rl.faults`)."""
        self.rollout.engines[i].kill()

    def kill_trainer(self, rank: int) -> None:
        """Kill trainer rank `rank` at once (fault injection: `rl.faults`)."""
        self.trainer.actors[rank].kill()

    def abandon(self) -> None:
        """A generation was given up on (stop request): engines may still be busy with it, so
        `shutdown` kills them instead of asking."""
        self._abandoned = True

    # ---- teardown --------------------------------------------------------------------------
    def _kill(self, actors: list) -> None:
        for a in actors:
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
        engines, trainers = list(self.rollout.engines), list(self.trainer.actors)
        if failed:
            self._kill(engines + trainers)
            return
        for a in engines + trainers:
            if self._abandoned and a in engines:
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

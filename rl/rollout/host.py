"""`EngineHost`: the worker class Ray (or a plain process) hosts for each rollout engine.

It builds the configured engine inside the actor process and forwards the driver's calls
(`rl.cluster.facades.RolloutGroup` names them), timing the ones that keep the engine busy.
"""
from __future__ import annotations

import os
import time

import torch

from rl.rollout.base import SamplingParams


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

"""The trainer -> rollout weight updates, seen from the driver: which version the engines hold,
how a dead engine is replaced and brought to it, and the proof that the weights arrived.

Every driver call that needs all engines goes through `WeightPublisher.retry`: a dead engine is
restarted at the current version and the call made again (slime's updater owns the version the
same way).
"""
from __future__ import annotations

import logging
from typing import Callable, TypeVar

from rl.cluster.actors import ActorDied
from rl.config import Config
from rl.faults import FaultInjector
from rl.rollout.base import Sample, SamplingParams
from rl.sync.transport import SyncError

log = logging.getLogger(__name__)

T = TypeVar("T")
RETRIES = 2
"""How often a call that met a dead engine is made again (after restarting it)."""


class WeightPublisher:
    def __init__(self, cfg: Config, runtime, probe: tuple[list[int], list[int]],
                 step_in_progress: Callable[[], int], faults: FaultInjector | None = None):
        """`runtime`: `rl.runtime.Runtime`. `probe`: (prompt, response) token ids the log-prob
        check scores on both sides. `step_in_progress()` names the step for fault injection."""
        self.runtime, self.probe, self.step_in_progress = runtime, probe, step_in_progress
        self.check, self.tol = cfg.sync.check_logprobs, cfg.sync.check_logprobs_tol
        self.faults = faults or FaultInjector()
        self.weight_version = 0
        """The version the engines hold (the trainer's after the last `publish`)."""
        self.restarts_before = 0
        """Engine restarts in earlier lives of this run (before the last resume)."""

    @property
    def restarts(self) -> int:
        """Engine restarts over all lives of the run."""
        return self.restarts_before + self.runtime.restarts

    def state_dict(self) -> dict:
        return {"weight_version": self.weight_version, "restarts_before": self.restarts}

    def load_state_dict(self, state: dict) -> None:
        self.weight_version = state["weight_version"]
        self.restarts_before = state["restarts_before"]

    def retry(self, point: str, fn: Callable[[], T], step: int | None = None) -> T:
        """`fn()`, a call that needs every engine; if one died, it is restarted, brought to the
        current weights, and `fn` runs again (at most RETRIES more times). `point` names the
        call for fault injection (`rl.faults`)."""
        self.faults.at(point, self.step_in_progress() if step is None else step, self.runtime)
        for attempt in range(RETRIES + 1):
            try:
                return fn()
            except ActorDied as e:
                if attempt == RETRIES:
                    raise
                log.warning("%s: a rollout engine died (%s); restarting it and retrying", point, e)
                self.runtime.restart_dead_engines(self.weight_version)
        raise AssertionError("unreachable")

    def publish(self, version: int) -> dict:
        """Bring every engine to the trainer's weights as `version`; trainer-side sync stats
        (with `logprob_max_diff` when sync.check_logprobs)."""
        self.faults.at("sync", self.step_in_progress(), self.runtime)
        try:
            stats = self.runtime.weight_sync.update(version)
        except (ActorDied, SyncError) as e:
            # A rollout engine died (before or during the update): replace it; the replacement
            # is brought to `version` as part of the restart. Anything else is fatal.
            if not self.runtime.restart_dead_engines(version):
                raise
            log.warning("weight sync failed (%s); engines restarted and re-synced", e)
            stats = {"seconds": 0.0, "bytes": 0, "gbytes_per_s": 0.0}
        self.weight_version = version
        versions = self.retry("versions", self.runtime.rollout.versions)
        if any(v != version for v in versions):
            raise RuntimeError(f"weight sync: engines report versions {versions}, expected "
                               f"{version}")
        if self.check:
            stats["logprob_max_diff"] = self.check_logprobs()
        return stats

    def check_logprobs(self) -> float:
        """Max |trainer - engine| log-prob over the probe sequence: proves the weights arrived."""
        prompt, response = self.probe
        ref = self.runtime.trainer.score([prompt], [response])[0]
        scores = self.retry("probe", lambda: self.runtime.rollout.score([prompt], [response]))
        worst = 0.0
        for engine_scores in scores:
            worst = max(worst, max(abs(a - b) for a, b in zip(ref, engine_scores[0])))
        if worst > self.tol:
            raise RuntimeError(f"after the weight sync the rollout engine's log-probs differ from "
                               f"the trainer's by {worst:.2e} (> sync.check_logprobs_tol "
                               f"{self.tol:.0e}): the weights did not arrive intact")
        return worst

    def busy_seconds(self) -> float:
        """Mean seconds each engine spent working so far (idle-ratio metrics)."""
        return self.retry("busy_poll", self.runtime.rollout.busy_seconds)


class Generator:
    """Generations on the rollout engines, with the publisher's recovery: a generation that
    met a dead engine is launched again once the engine is back at the current weights (its
    samples then carry the version the driver last published)."""

    def __init__(self, runtime, publisher: WeightPublisher):
        self.runtime, self.publisher = runtime, publisher

    def start(self, prompts: list[list[int]], sampling: SamplingParams, seed: int,
              examples: list | None = None):
        """A `rl.cluster.facades.Generation` in flight (returns at once). `examples` (the
        prompts' data rows) are for the multi-turn generator (`rl.envs.generator`)."""
        return self.runtime.rollout.generate_async(prompts, sampling, seed)

    def finish(self, gen, prompts: list[list[int]], sampling: SamplingParams, seed: int,
               examples: list | None = None) -> tuple[list[list[Sample]], float]:
        """(samples per prompt, seconds) of `gen`, started by `start(prompts, sampling, seed)`."""
        first = [gen]

        def attempt():
            g = first.pop() if first else self.start(prompts, sampling, seed)
            return g.result(), g.seconds
        return self.publisher.retry("generate", attempt)

    def abandon(self) -> None:
        """A generation was given up on (stop): the engines may still be busy with it."""
        self.runtime.abandon()

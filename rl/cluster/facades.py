"""The driver's typed view of its two worker groups (slime's actor-group facade is the model).

`TrainerGroup` wraps the trainer ranks (`rl.trainer.worker.TrainerWorker`), `RolloutGroup` the
engines (`rl.rollout.host.EngineHost`); behind them are Ray actors or plain processes
(`rl.cluster.actors`). `*_async` methods return futures, the others block. The method names of
the workers appear here and nowhere else in the driver.

Every blocking method waits under its deadline (`cluster.deadlines`, `rl.cluster.actors.wait_all`):
a hung rank raises `CallTimeout`, a dead one `ActorDied` at once.
"""
from __future__ import annotations

import dataclasses
import time

from rl.cluster.actors import CallTimeout, Future, wait_all, wait_each
from rl.config import DeadlinesConfig
from rl.rollout.base import Sample, SamplingParams
from rl.trainer.batch import TrainBatch, TrainStats


def _waiter(group: str, deadlines: DeadlinesConfig):
    """`wait(futures, call, key)`: `wait_all` under `cluster.deadlines.<key>`, naming the call."""
    def wait(futures: list[Future], call: str, key: str) -> list:
        return wait_all(futures, getattr(deadlines, key), f"{call} on the {group} group",
                        key=f"cluster.deadlines.{key}")
    return wait


class TrainerGroup:
    def __init__(self, actors: list, deadlines: DeadlinesConfig | None = None):
        self.actors = actors
        self.deadlines = deadlines or DeadlinesConfig()
        self._wait = _waiter("trainer", self.deadlines)

    def ping_async(self) -> list[Future]:
        return [a.call("ping") for a in self.actors]

    def train(self, batch: TrainBatch, step: int) -> TrainStats:
        """One step on every rank: the rank-agreed metrics and the old log-probs of every
        sample (each rank reports its shard's)."""
        results = self._wait([a.call("train_step", batch, step) for a in self.actors],
                             f"train_step of step {step}", "train_s")
        old: dict[int, list[float]] = {}
        for r in results:
            old.update(r.old_logprobs)
        return TrainStats(metrics=results[0].metrics, old_logprobs=old)

    def score(self, prompt_ids: list[list[int]], response_ids: list[list[int]]
              ) -> list[list[float]]:
        """Per-token log-probs of the responses (every rank takes part under ZeRO-3)."""
        return self._wait([a.call("score", prompt_ids, response_ids) for a in self.actors],
                          "score", "score_s")[0]

    def save(self, path: str, tag: str, client_state: dict, checksum: bool = True) -> dict:
        """Every rank writes, fsyncs and (with `checksum`) hashes its files. Returns {"files":
        {path relative to `path`: {"bytes", "sha256", "rank"}}, "seconds": the slowest rank's
        sealing time}. On failure every rank is waited for before the first error is raised
        (the failing rank's own, not another rank's `PeerSaveFailed`), so that no rank still
        writes into the directory the caller removes; a dead rank (ActorDied) or the deadline
        (`cluster.deadlines.save_s`) raises at once, and the run fails."""
        from rl.trainer.worker import PeerSaveFailed
        futures = [a.call("save", path, tag, client_state, checksum) for a in self.actors]
        # A dead rank raises at once: the others may wait for it in a collective forever.
        results = wait_each(futures, self.deadlines.save_s, "save on the trainer group",
                            key="cluster.deadlines.save_s")
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            raise next((e for e in errors if not isinstance(e, PeerSaveFailed)), errors[0])
        files = {rel: {**rec, "rank": rank} for rank, r in enumerate(results)
                 for rel, rec in r["files"].items()}
        return {"files": files, "seconds": max(r["seconds"] for r in results)}

    def sha256(self, path: str, by_rank: dict[int, list[str]]) -> dict[str, str]:
        """SHA-256 of the checkpoint files under `path` (relative paths), each file hashed by
        the rank that wrote it (rank modulo the ranks there are now), all ranks at once."""
        n = len(self.actors)
        share: dict[int, list[str]] = {}
        for rank, rels in by_rank.items():
            share.setdefault(rank % n, []).extend(rels)
        out: dict[str, str] = {}
        for part in self._wait([self.actors[r].call("sha256", path, rels)
                                for r, rels in share.items()], "sha256", "load_s"):
            out.update(part)
        return out

    @property
    def num_ranks(self) -> int:
        return len(self.actors)

    def load(self, path: str, tag: str) -> dict:
        return self._wait([a.call("load", path, tag) for a in self.actors], "load", "load_s")[0]

    # ---- weight sync (rank 0 sends; every rank takes part in gathering ZeRO-3 shards) ------
    def sync_plan(self):
        return self._wait([self.actors[0].call("sync_plan")], "sync_plan", "call_s")[0]

    def sync_address(self) -> tuple[str, int]:
        return self._wait([self.actors[0].call("sync_address")], "sync_address", "call_s")[0]

    def init_weight_sync_async(self, host: str, port: int, world_size: int,
                               backend: str | None = None) -> Future:
        """Rank 0 joins as the sender; `backend`: the transport (`rl.sync.backend`), None =
        decided from `sync.backend` and its own device alone."""
        return self.actors[0].call("init_weight_sync", host, port, world_size, backend)

    def close_weight_sync(self, deadline_s: float) -> None:
        """`deadline_s`: rank 0 may first finish a weight update stuck on a dead engine."""
        wait_all([self.actors[0].call("close_weight_sync")], deadline_s,
                 "close_weight_sync on the trainer group", key="sync.timeout_s")

    def send_weights_async(self, version: int) -> list[Future]:
        return [a.call("send_weights", version) for a in self.actors]


class Generation:
    """A generation in flight on the rollout engines; `result()` waits for it, within
    `deadline_s` of its launch (`cluster.deadlines.generate_s`)."""

    def __init__(self, futures: list, n_prompts: int, num_engines: int,
                 deadline_s: float | None = None):
        self._futures, self._n, self._m = futures, n_prompts, num_engines
        self._deadline_s = deadline_s
        self._deadline = None if deadline_s is None else time.monotonic() + deadline_s
        self.seconds = 0.0
        """Generation wall time (the slowest engine's), set by `result()`."""

    def _left(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def _timeout(self) -> CallTimeout:
        return CallTimeout("generate on the rollout group", self._deadline_s,
                           "cluster.deadlines.generate_s",
                           [f.name for _, f in self._futures if not f.done()])

    def wait(self, timeout: float) -> bool:
        """True when every engine has answered (a dead one raises at `result`), within
        `timeout` s; CallTimeout once the generation's deadline has passed."""
        deadline = time.monotonic() + timeout
        for _, f in self._futures:
            try:
                f.result(timeout=max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                if self._left() == 0.0:
                    raise self._timeout() from None
                return False
            except Exception:  # noqa: BLE001 - answered with an error: `result` raises it
                pass
        return True

    def result(self) -> list[list[Sample]]:
        futures = [f for _, f in self._futures]
        answers = wait_all(futures, self._left(), "generate on the rollout group",
                           key="cluster.deadlines.generate_s")
        per_engine = {i: r for (i, _), r in zip(self._futures, answers)}
        self.seconds = max((r["seconds"] for r in per_engine.values()), default=0.0)
        out: list[list[Sample]] = [None] * self._n  # type: ignore[list-item]
        for i, r in per_engine.items():
            for j, samples in enumerate(r["groups"]):
                out[i + j * self._m] = samples
        return out


class RolloutGroup:
    def __init__(self, engines: list, deadlines: DeadlinesConfig | None = None):
        self._engines = list(engines)
        self.deadlines = deadlines or DeadlinesConfig()
        self._wait = _waiter("rollout", self.deadlines)

    @property
    def engines(self) -> tuple:
        """The engine handles, in order (this group owns them: `replace` swaps one)."""
        return tuple(self._engines)

    def replace(self, i: int, engine) -> None:
        """Engine i is `engine` from now on (the runtime restarted a dead one)."""
        self._engines[i] = engine

    def dead(self, timeout_s: float = 30) -> list[int]:
        """Indices of the engines that do not answer within `timeout_s` each."""
        dead = []
        for i in range(len(self._engines)):
            try:
                self.pid_async(i).result(timeout=timeout_s)
            except Exception:  # noqa: BLE001 - any failure to answer means it is gone
                dead.append(i)
        return dead

    def generate_async(self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int
                       ) -> Generation:
        """Starts generating and returns at once (the engines work while the driver trains).

        Prompts are split evenly over engines (in order); engine i samples with seed + i. An
        engine serves its calls in order, so a weight update sent later waits for this call.
        """
        m = len(self._engines)
        futures = []
        for i, engine in enumerate(self._engines):
            chunk = prompt_ids[i::m]
            if chunk:
                sp = dataclasses.replace(sampling, seed=seed + i)
                futures.append((i, engine.call("generate", chunk, sp)))
        return Generation(futures, len(prompt_ids), m, self.deadlines.generate_s)

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int
                 ) -> list[list[Sample]]:
        return self.generate_async(prompt_ids, sampling, seed).result()

    def score(self, prompt_ids, response_ids) -> list[list[list[float]]]:
        """Each engine's per-token log-probs of the responses."""
        return self._wait([e.call("score", prompt_ids, response_ids) for e in self._engines],
                          "score", "score_s")

    def busy_seconds(self) -> float:
        """Mean over engines of the seconds each spent working (generate, score, receive)."""
        busy = self._wait([e.call("busy_seconds") for e in self._engines], "busy_seconds",
                          "call_s")
        return sum(busy) / len(busy)

    def versions(self) -> list[int]:
        return self._wait([e.call("weight_version") for e in self._engines], "weight_version",
                          "call_s")

    def pid_async(self, i: int) -> Future:
        """Engine i's process id: answers iff it is alive."""
        return self._engines[i].call("pid")

    def num_sync_ranks(self) -> list[int]:
        return self._wait([e.call("num_sync_ranks") for e in self._engines], "num_sync_ranks",
                          "call_s")

    def init_weight_sync_async(self, host: str, port: int, world_size: int, sizes: list[int],
                               backend: str, timeout_s: float) -> list[Future]:
        """Engine k joins with ranks 1 + sum(sizes[:k]) ... (trainer rank 0 is rank 0)."""
        futures, first = [], 1
        for e, size in zip(self._engines, sizes):
            futures.append(e.call("init_weight_sync", host, port, world_size, first, backend,
                                  timeout_s))
            first += size
        return futures

    def receive_weights_async(self, plan, version: int) -> list[Future]:
        return [e.call("receive_weights", plan, version) for e in self._engines]

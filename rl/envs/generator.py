"""Multi-turn generations for the rollout pipeline, with the single-turn `Generator`'s verbs.

`MultiTurnGenerator.start` returns at once: the episodes run in one background driver thread
(engine calls through the wrapped `rl.publisher.Generator`, so a dead engine is restarted and
the turn retried; environment steps through the `EnvPool`), while the trainer trains, as a
single-turn generation does on the engines. Batches run one after another in launch order.
`abandon` makes a running batch give up at its next poll (StepAbandoned in its thread).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Callable

from rl.envs.episodes import EpisodeRunner
from rl.envs.tools import ToolFormat
from rl.rollout.base import Sample, SamplingParams
from rl.signals import StepAbandoned

POLL_S = 0.05


def example_row(example) -> dict:
    """The row an environment starts from (`rl.data.example.Example`): its meta fields, then
    `prompt` and `answer`."""
    return {**example.meta, "prompt": example.prompt, "answer": example.answer}


class EpisodeBatch:
    """A multi-turn batch in flight (the interface of `rl.cluster.facades.Generation`)."""

    def __init__(self, future: Future, cancel: threading.Event):
        self.future, self.cancel = future, cancel

    def wait(self, timeout: float) -> bool:
        return bool(wait_futures([self.future], timeout=timeout).done)

    def result(self) -> tuple[list, float]:
        return self.future.result()


class MultiTurnGenerator:
    multi_turn = True
    """The rollout pipeline passes each batch's examples (`RolloutPipeline._rows`)."""

    def __init__(self, generator, pool, tool_format: ToolFormat, tokenizer, max_turns: int,
                 max_tokens: int, max_model_len: int):
        """`generator`: `rl.publisher.Generator`; `pool`: `rl.envs.pool.EnvPool` (closed with
        this object)."""
        self.generator, self.pool = generator, pool
        self.tool_format, self.tokenizer = tool_format, tokenizer
        self.max_turns, self.max_tokens, self.max_model_len = max_turns, max_tokens, max_model_len
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="episodes")
        self._running: list[EpisodeBatch] = []

    def runner(self, cancelled: Callable[[], bool] = lambda: False) -> EpisodeRunner:
        """Episodes on the engines (through the wrapped Generator) and the pool; a generation
        gives up (StepAbandoned) once `cancelled()` is true."""
        def generate(prompts, sampling, seed):
            gen = self.generator.start(prompts, sampling, seed)
            while not gen.wait(POLL_S):
                if cancelled():
                    raise StepAbandoned("stop requested during a multi-turn generation")
            return self.generator.finish(gen, prompts, sampling, seed)[0]
        return EpisodeRunner(generate=generate, map_steps=self.pool.map,
                             tool_format=self.tool_format, tokenizer=self.tokenizer,
                             max_turns=self.max_turns, max_tokens=self.max_tokens,
                             max_model_len=self.max_model_len)

    def start(self, prompts: list[list[int]], sampling: SamplingParams, seed: int,
              examples: list | None = None, pause_at: int | None = None) -> EpisodeBatch:
        """`sampling.n` episodes of each prompt, each started from its example; with
        `pause_at`, episodes pause at that many response tokens (`EpisodeRunner.run`)."""
        if examples is None or len(examples) != len(prompts):
            raise ValueError("multi-turn generation needs one example per prompt")
        rows = [example_row(ex) for ex in examples]
        return self._submit(lambda cancelled: self.runner(cancelled).run(
            prompts, rows, sampling, seed, cancelled, pause_at))

    def resume(self, samples: list[Sample], examples: list, sampling: SamplingParams,
               seed: int) -> EpisodeBatch:
        """Continue paused episodes (`Sample.paused`; `examples[i]`: the example `samples[i]`
        started from) with the engines' weights; `finish` gives them back in order."""
        rows = [example_row(ex) for ex in examples]
        return self._submit(lambda cancelled: self.runner(cancelled).resume(
            samples, rows, sampling, seed, cancelled))

    def _submit(self, work: Callable[[Callable[[], bool]], list]) -> EpisodeBatch:
        cancel = threading.Event()

        def job() -> tuple[list, float]:
            t0 = time.perf_counter()
            out = work(cancel.is_set)
            return out, time.perf_counter() - t0
        batch = EpisodeBatch(self._executor.submit(job), cancel)
        self._running = [b for b in self._running if not b.future.done()] + [batch]
        return batch

    def finish(self, gen: EpisodeBatch, prompts, sampling, seed, **_) -> tuple[list, float]:
        return gen.result()

    def abandon(self) -> None:
        for b in self._running:
            b.cancel.set()
        self._running = []
        self.generator.abandon()

    def close(self) -> None:
        for b in self._running:
            b.cancel.set()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.pool.close()

    @classmethod
    def from_config(cls, cfg, generator, tokenizer, pool) -> MultiTurnGenerator:
        """For a `rl.config.Config` with `env.path` set (`pool`: `start_pool(cfg)`)."""
        from rl.envs.tools import tool_format
        env = cfg.env
        fmt = tool_format(env.tool_format, cfg.data.format, cfg.data.deepseek_v4.thinking)
        return cls(generator, pool, fmt, tokenizer, env.max_turns, env.max_response_tokens,
                   cfg.rollout.max_model_len)


def start_pool(cfg):
    """The environment workers of a `rl.config.Config` (`rl.envs.pool.EnvPool`), None without
    `env.path`; ConfigError when the class cannot be imported."""
    if cfg.env.path is None:
        return None
    from rl.envs.pool import EnvPool
    from rl.rewards.pool import auto_workers
    env = cfg.env
    workers = auto_workers() if env.num_workers == "auto" else env.num_workers
    return EnvPool(env.path, workers, env.step_timeout_s)

"""Rollout batches between the rollout group and the trainer group: on-policy or bounded staleness.

`algorithm.max_staleness = 0`: the step's batch is generated when the step starts, with the
weights the trainer holds (`take` generates it now).

`max_staleness = k >= 1`: right after a step takes its batch, the batches of steps step+1 ..
step+k that are not generated yet are launched on the engines (`launch_ahead`), which generate
them with the weights they hold while the trainer trains; the driver collects them (`collect`)
before it pushes the new weights. A sample is trained at most k versions after the weights that
sampled it. In steady state one batch is launched per step, at the start of the step.

`partial_rollouts` decides what the weight update does to a generation that is still running:
`finish` waits for it (all tokens from the old weights); `resume` launches background batches
with a budget of `partial_tokens` new tokens, and `take` continues every sample cut by that
budget with the new weights before the step trains on it. Each sample records the version of
each of its token spans (`Sample.version_spans`). The interrupt is a token budget, not a moment
in time: which tokens came from which weights is a function of the config, so a run and its
resume compute the same thing.

With `algorithm.dynamic_sampling` the loop asks for refill rounds (`refill`) once it has scored
the step's batch: more prompts drawn and generated now, with the current weights, before the
next steps' batches are launched (`rl.dynamic_sampling`).

Batches generated ahead are part of the checkpoint (`state_dict`), with their versions: at a
checkpoint nothing is in flight (the driver collects before it syncs), and a resumed run trains
on exactly the samples the uninterrupted run would have.

After a stop request the pipeline gives up waiting (`StepAbandoned`) so that the checkpoint lands
within `checkpoint.grace_period_s`: before training at once (`abandon` puts the step's batch back
and the driver rewinds the sampler: the resumed run redoes the step exactly); after training, on
batches launched ahead, only once the grace left is what the checkpoint write needs (1.5x the last
write, half the grace period before the first). Such a batch is dropped and its prompts drawn
again by the resumed run, which generates them with the newer weights: the one place where a
stopped and resumed run is not bitwise the uninterrupted one (logged).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from typing import Callable

from rl.config import Config
from rl.rollout.base import Sample, SamplingParams, decode_response
from rl.signals import StepAbandoned, StopRequest

log = logging.getLogger(__name__)


def rollout_seed(seed: int, step: int) -> int:
    """The rollout sampling seed stream: a pure function of (seed, step), so resume replays it."""
    return (seed * 1_000_003 + step * 1_009) % (2**31 - 1)


def resume_seed(seed: int, step: int) -> int:
    """Seed of the call that resumes a step's interrupted samples (its own stream)."""
    return (rollout_seed(seed, step) + 7_919) % (2**31 - 1)


def refill_seed(seed: int, step: int, round_no: int) -> int:
    """Seed of dynamic sampling's refill round `round_no` (>= 1) of a step (`rl.dynamic_sampling`):
    a stream of its own, apart from every step's rollout and resume seeds."""
    return (rollout_seed(seed, step) + 15_485_863 * round_no) % (2**31 - 1)


@dataclass(slots=True)
class RolloutBatch:
    step: int
    """The step that trains on this batch."""
    indices: list[int]
    """Training-set index of each prompt."""
    groups: list[list[Sample]] = field(default_factory=list)
    seconds: float = 0.0
    """Generation wall time of all its segments [s]."""
    ahead: bool = False
    """Generated in the background during an earlier step (else when its step started)."""

    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g]

    def to_state(self) -> dict:
        return {"step": self.step, "indices": list(self.indices), "seconds": self.seconds,
                "ahead": self.ahead, "groups": [[_sample_state(s) for s in g] for g in self.groups]}

    @classmethod
    def from_state(cls, d: dict) -> RolloutBatch:
        groups = [[Sample(**{**s, "version_spans": [tuple(x) for x in s["version_spans"]]})
                   for s in g] for g in d["groups"]]
        return cls(step=d["step"], indices=list(d["indices"]), groups=groups,
                   seconds=d["seconds"], ahead=d["ahead"])


def _sample_state(s: Sample) -> dict:
    """A sample as checkpoint state: a paused episode's environment instance stays out (a
    checkpoint never holds a pickle; the resumed run rebuilds it from the messages)."""
    d = dataclasses.asdict(s)
    if d["paused"] is not None:
        d["paused"]["env_state"] = None
    return d


def staleness(samples: list[Sample], trainer_version: int) -> list[int]:
    """How many weight versions each sample's oldest token lags the policy that trains on it."""
    return [trainer_version - s.oldest_version for s in samples]


def stale_groups(groups: list[list[Sample]], trainer_version: int, bound: int) -> list[bool]:
    """Per prompt group: True when any of its samples is more than `bound` versions old.

    Whole groups go: GRPO's advantages are relative within a group, so a group missing some of
    its samples would carry a biased baseline.
    """
    return [any(lag > bound for lag in staleness(g, trainer_version)) for g in groups]


class RolloutPipeline:
    """Owns the batches generated ahead of their step; the loop asks it for each step's batch.

    Collaborators: `source` (`rl.data.source.PromptSource`: draws prompts, holds their token
    ids and the tokenizer), `generator` (`rl.publisher.Generator`: generations with engine
    recovery), `checkpoint_seconds()` (how long the last checkpoint write took, or None).
    """

    def __init__(self, cfg: Config, source, generator, sampling: SamplingParams,
                 stop: StopRequest | None = None,
                 checkpoint_seconds: Callable[[], float | None] = lambda: None):
        self.source, self.generator, self.sampling = source, generator, sampling
        self.checkpoint_seconds = checkpoint_seconds
        self.prompts_per_step = cfg.algorithm.prompts_per_step
        self.stop = stop or StopRequest()
        self.grace_s = cfg.checkpoint.grace_period_s
        self.seed = cfg.rollout.seed
        self.ahead = cfg.algorithm.max_staleness
        self.mode = cfg.algorithm.partial_rollouts
        self.stale_samples = cfg.algorithm.stale_samples
        self.max_new = sampling.max_new_tokens
        self.budget = cfg.algorithm.partial_tokens or max(1, cfg.response_budget // 2)
        """Interrupt budget of `resume`: new tokens of a generation, response tokens of an
        episode (`rl.envs.episodes`)."""
        self.multi_turn = bool(getattr(generator, "multi_turn", False))
        self.pending: list[RolloutBatch] = []
        self._in_flight: list[tuple[RolloutBatch, object, dict]] = []
        """(batch, generation, sampler state before its prompts were drawn)."""
        self._taken: dict | None = None
        """The current step's batch as it was pending (put back if the step is abandoned)."""

    # ---- state -------------------------------------------------------------------------------
    def state_dict(self) -> list[dict]:
        if self._in_flight:
            raise RuntimeError("rollout pipeline: cannot checkpoint while generations are in flight")
        return [b.to_state() for b in self.pending]

    def load_state_dict(self, state: list[dict]) -> None:
        self.pending = [RolloutBatch.from_state(d) for d in state]

    @property
    def ahead_sampling(self) -> SamplingParams:
        """Sampling of the batches generated ahead: cut at the interrupt budget in `resume` mode."""
        if self._interrupts and not self.multi_turn:
            return dataclasses.replace(self.sampling, max_new_tokens=self.budget)
        return self.sampling

    @property
    def _interrupts(self) -> bool:
        """Generations launched ahead stop at the interrupt budget (`resume`)."""
        return self.ahead > 0 and self.mode == "resume" and (
            self.multi_turn or self.budget < self.max_new)

    # ---- the loop's verbs --------------------------------------------------------------------
    def take(self, step: int) -> RolloutBatch:
        """The batch of `step`: generated ahead (interrupted samples resumed now), or generated
        now with the current weights when none is pending."""
        old = [b.step for b in self.pending if b.step < step]
        if old:  # cannot happen in a run; guards hand-edited or foreign checkpoints
            log.warning("rollout pipeline: dropping pending batches of past steps %s", old)
            self.pending = [b for b in self.pending if b.step >= step]
        self._taken = None
        if self.pending and self.pending[0].step == step:
            batch = self.pending.pop(0)
            self._taken = batch.to_state()
            self._resume_interrupted(batch)
            return batch
        return self.generate_now(step)

    def drop_stale(self, batch: RolloutBatch, weight_version: int) -> tuple[RolloutBatch, int]:
        """`batch` without its prompt groups more than max_staleness versions behind
        `weight_version` (algorithm.stale_samples: drop; e.g. after lowering max_staleness on
        resume), and how many samples went. A batch left empty is generated again, on-policy."""
        stale = stale_groups(batch.groups, weight_version, self.ahead)
        if not any(stale) or self.stale_samples != "drop":
            return batch, 0
        dropped = sum(len(g) for g, old in zip(batch.groups, stale) if old)
        log.warning("step %d: dropping %d of %d prompt groups older than max_staleness %d",
                    batch.step, sum(stale), len(stale), self.ahead)
        keep = [i for i, old in enumerate(stale) if not old]
        batch.groups = [batch.groups[i] for i in keep]
        batch.indices = [batch.indices[i] for i in keep]
        return (batch if keep else self.generate_now(batch.step)), dropped

    def abandon(self) -> None:
        """Forget the current step after a stop, before it trained: its batch goes back to
        `pending` as it was, batches launched ahead are dropped unobserved (the caller rewinds the
        sampler to the step's start)."""
        if self._in_flight:
            self.generator.abandon()
        self._in_flight.clear()
        if self._taken is not None:
            self.pending.insert(0, RolloutBatch.from_state(self._taken))
            self._taken = None

    def generate_now(self, step: int) -> RolloutBatch:
        """A fresh batch for `step` with the weights the engines hold now (blocks)."""
        return self._generate(step, self.prompts_per_step, rollout_seed(self.seed, step))

    def refill(self, step: int, round_no: int, k: int) -> RolloutBatch:
        """Dynamic sampling's round `round_no` (>= 1) of `step`: k more prompts, drawn now and
        generated with the weights the engines hold now (blocks; `rl.dynamic_sampling`)."""
        return self._generate(step, k, refill_seed(self.seed, step, round_no))

    def _generate(self, step: int, k: int, seed: int) -> RolloutBatch:
        indices = self.source.draw(k)
        batch = RolloutBatch(step=step, indices=indices)
        prompts, rows = self.source.prompts(indices), self._rows(indices)
        gen = self.generator.start(prompts, self.sampling, seed, **rows)
        self._await(gen, self._stopped)
        batch.groups, batch.seconds = self.generator.finish(gen, prompts, self.sampling, seed,
                                                            **rows)
        return batch

    def launch_ahead(self, step: int, last_step: int) -> None:
        """Start generating the batches of steps step+1 .. step+max_staleness (<= last_step) that
        are neither pending nor in flight; prompts are drawn now, in step order."""
        have = {b.step for b in self.pending} | {b.step for b, _, _ in self._in_flight}
        sampling = self.ahead_sampling
        for t in range(step + 1, min(step + self.ahead, last_step) + 1):
            if t in have:
                continue
            drawn_from = self.source.state_dict()
            indices = self.source.draw(self.prompts_per_step)
            gen = self.generator.start(self.source.prompts(indices), sampling,
                                       rollout_seed(self.seed, t), **self._rows(indices, True))
            self._in_flight.append((RolloutBatch(step=t, indices=indices, ahead=True), gen,
                                    drawn_from))

    def collect(self) -> None:
        """Wait for the generations launched ahead (before the weights change under them).

        After a stop request, only while the grace period leaves time for the checkpoint: the
        rest are dropped and the sampler rewound to before their prompts were drawn."""
        sampling = self.ahead_sampling
        for k, (batch, gen, drawn_from) in enumerate(self._in_flight):
            try:
                self._await(gen, self._out_of_grace)
            except StepAbandoned:
                dropped = [b.step for b, _, _ in self._in_flight[k:]]
                log.warning("stop: dropping the unfinished batches of steps %s to checkpoint within "
                            "checkpoint.grace_period_s; the resumed run generates them again with "
                            "newer weights", dropped)
                self.source.load_state_dict(drawn_from)
                break
            batch.groups, batch.seconds = self.generator.finish(
                gen, self.source.prompts(batch.indices), sampling,
                rollout_seed(self.seed, batch.step), **self._rows(batch.indices, True))
            self.pending.append(batch)
        self._in_flight.clear()
        self.pending.sort(key=lambda b: b.step)

    # ---- helpers -----------------------------------------------------------------------------
    def _rows(self, indices: list[int], ahead: bool = False) -> dict:
        """The keywords a multi-turn generator (`rl.envs.generator`) takes: the prompts'
        examples, which start their episodes, and for a batch launched ahead the interrupt
        budget of `resume`; nothing for a single-turn one."""
        if not self.multi_turn:
            return {}
        pause = {"pause_at": self.budget} if ahead and self._interrupts else {}
        return {"examples": self.source.examples(indices), **pause}

    def _stopped(self) -> bool:
        return self.stop.requested

    def _out_of_grace(self) -> bool:
        """True once a stop request's grace period has only the checkpoint write's time left."""
        last = self.checkpoint_seconds()
        reserve = 1.5 * last if last is not None else self.grace_s / 2
        return self.stop.requested and self.stop.seconds_left(self.grace_s) <= reserve

    def _await(self, gen, give_up, poll_s: float = 0.1) -> None:
        """Blocks until `gen` is done; raises StepAbandoned as soon as `give_up()` says so."""
        while not gen.wait(poll_s):
            if give_up():
                self.generator.abandon()  # the engines finish it unobserved
                raise StepAbandoned("stop requested while a generation was in flight")

    def _resume_interrupted(self, batch: RolloutBatch) -> None:
        """Continue, with the current weights, every sample the interrupt budget cut short."""
        if self.multi_turn:
            self._resume_episodes(batch)
            return
        cut = [(gi, si) for gi, g in enumerate(batch.groups) for si, s in enumerate(g)
               if s.finish_reason == "length" and len(s.response_ids) < self.max_new]
        if not cut:
            return
        budgets = {self.max_new - len(batch.groups[gi][si].response_ids) for gi, si in cut}
        if len(budgets) != 1:
            raise RuntimeError(f"rollout pipeline: interrupted samples of step {batch.step} have "
                               f"different lengths left {sorted(budgets)}; expected one budget")
        prompts = [batch.groups[gi][si].prompt_ids + batch.groups[gi][si].response_ids
                   for gi, si in cut]
        sampling = dataclasses.replace(self.sampling, n=1, max_new_tokens=budgets.pop())
        seed = resume_seed(self.seed, batch.step)
        gen = self.generator.start(prompts, sampling, seed)
        self._await(gen, self._stopped)
        out, seconds = self.generator.finish(gen, prompts, sampling, seed)
        batch.seconds += seconds
        tokenizer = self.source.tokenizer
        for (gi, si), (new,) in zip(cut, out):
            old = batch.groups[gi][si]
            tokens = old.response_ids + new.response_ids
            batch.groups[gi][si] = Sample(
                prompt_ids=old.prompt_ids, response_ids=tokens,
                text=decode_response(tokenizer, tokens, new.finish_reason),
                logprobs=old.logprobs + new.logprobs, finish_reason=new.finish_reason,
                weight_version=new.weight_version,
                version_spans=old.spans() + [(len(old.response_ids), new.weight_version)],
                routing=new.routing)  # the resuming call re-ran the whole prefix

    def _resume_episodes(self, batch: RolloutBatch) -> None:
        """`_resume_interrupted` for multi-turn episodes: continue every paused one."""
        paused = [(gi, si) for gi, g in enumerate(batch.groups) for si, s in enumerate(g)
                  if s.paused is not None]
        if not paused:
            return
        seed = resume_seed(self.seed, batch.step)
        gen = self.generator.resume([batch.groups[gi][si] for gi, si in paused],
                                    self.source.examples([batch.indices[gi] for gi, _ in paused]),
                                    self.sampling, seed)
        self._await(gen, self._stopped)
        out, seconds = self.generator.finish(gen, None, self.sampling, seed)
        batch.seconds += seconds
        for (gi, si), s in zip(paused, out):
            batch.groups[gi][si] = s

"""Multi-turn episodes: engine generation and environment steps, alternating.

Turn 1 generates `sampling.n` samples of every prompt; each is an episode. After each model turn
the environment steps every episode still running (in its worker processes), then every episode
that got an observation takes its next turn, all in one engine call whose prompts are the whole
context so far (prompt, earlier turns, observations): vLLM finds that prefix in its prefix cache,
the HF and native engines compute it again. An episode ends when the environment says `done`
(its reward), when it fails (reward 0, `env_error`), or when it is cut (reward 0, finish reason
`length`): `max_turns` model turns taken, or no room left in its `max_tokens` response budget.

Seeds: turn 1 samples with the call's seed, turn t with `turn_seed(seed, t)`; which episodes a
turn's call holds is a function of the previous turns, so a rerun with the same weights and the
same environment is the same episodes.

Partial rollouts (`algorithm.partial_rollouts: resume`): episodes generated ahead run with
`pause_at`, and an episode that holds that many response tokens (model and environment tokens)
pauses, in the middle of a model turn or between an observation and the next turn; `resume`
continues it with the weights of the step that trains on it, each call of the resume seeded
`turn_seed(seed, round)`. Its environment instance travels with it in memory; after a restart
(a paused episode in a checkpoint) it is rebuilt by stepping a new instance with the messages
it got, which the protocol allows (an environment depends only on its row and its messages),
and an environment whose replayed observations differ fails the episode.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Callable

from rl.envs.tools import ToolFormat
from rl.rollout.base import Sample, SamplingParams, decode_response

Generate = Callable[[list[list[int]], SamplingParams, int], list[list[Sample]]]
"""(prompts, sampling, seed) -> samples per prompt, blocking."""


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn `turn` (1-based) of a call seeded `seed`."""
    return seed if turn == 1 else (seed + 104_729 * (turn - 1)) % (2**31 - 1)


@dataclass(slots=True)
class _Episode:
    prompt_ids: list[int]
    row: dict
    budget: int
    """Response tokens this episode may hold (model and environment tokens)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    """What the environment got, turn by turn (replayed to rebuild it, module docstring)."""
    state: bytes | None = None
    last: Sample | None = None
    reward: float = 0.0
    error: str | None = None
    finish: str = "stop"
    done: bool = False
    paused: bool = False
    mid_turn: bool = False
    """Paused inside a model turn: the next call continues that turn."""

    @classmethod
    def from_sample(cls, s: Sample, row: dict, budget: int) -> _Episode:
        """The paused episode `s` (`Sample.paused`), to be continued."""
        p = s.paused or {}
        return cls(prompt_ids=list(s.prompt_ids), row=row, budget=budget,
                   tokens=list(s.response_ids), logprobs=list(s.logprobs),
                   mask=list(s.loss_mask or []), turns=[dict(t) for t in s.turns or []],
                   spans=list(s.spans()), messages=list(p.get("messages", [])),
                   state=p.get("env_state"), last=s, finish=s.finish_reason,
                   mid_turn=bool(p.get("mid_turn")))

    def turn_tokens(self) -> int:
        """Tokens of the model turn a call adds to: the unfinished one when paused mid-turn."""
        return len(self.tokens) - self.turns[-1]["start"] if self.mid_turn else 0

    def add_turn(self, s: Sample, max_new: int, pause_at: int | None) -> None:
        """Append the model's turn `s` (or the rest of the turn it was paused in), cut to what
        the budget and the turn's `max_new` tokens leave; pause it when `pause_at` cut it."""
        room = min(self.budget - len(self.tokens), max_new - self.turn_tokens())
        pause_room = None if pause_at is None else pause_at - len(self.tokens)
        take = min(room, pause_room) if pause_room is not None else room
        tokens, logprobs = s.response_ids[:take], s.logprobs[:take]
        if not self.spans or self.spans[-1][1] != s.weight_version:
            self.spans.append((len(self.tokens), s.weight_version))
        if self.mid_turn:
            self.turns[-1]["end"] += len(tokens)
        else:
            self.turns.append({"start": len(self.tokens), "end": len(self.tokens) + len(tokens),
                               "tool_calls": [], "observation": None})
        self.tokens += tokens
        self.logprobs += logprobs
        self.mask += [1] * len(tokens)
        self.last = s
        whole = len(tokens) == len(s.response_ids)
        self.finish = s.finish_reason if whole else "length"
        # paused only where the interrupt, not the turn's or the episode's own limit, cut it
        self.paused = self.mid_turn = (pause_room is not None and pause_room < room
                                       and len(tokens) == pause_room
                                       and not (whole and s.finish_reason == "stop"))

    def end(self, reward: float, finish: str, error: str | None = None) -> None:
        self.reward, self.finish, self.error, self.done = reward, finish, error, True

    def to_sample(self, tokenizer) -> Sample:
        s = self.last
        assert s is not None
        routing = s.routing
        if routing is not None:  # the last call ran the whole context; cut tokens beyond it
            routing = routing[: len(self.prompt_ids) + len(self.tokens) - 1]
        spans = self.spans if len(self.spans) > 1 else []
        paused = None
        if self.paused:
            paused = {"mid_turn": self.mid_turn, "messages": list(self.messages),
                      "env_state": self.state}
        return Sample(prompt_ids=self.prompt_ids, response_ids=self.tokens,
                      text=decode_response(tokenizer, self.tokens, self.finish),
                      logprobs=self.logprobs, finish_reason=self.finish,  # type: ignore[arg-type]
                      weight_version=s.weight_version, version_spans=spans, routing=routing,
                      loss_mask=self.mask, turns=self.turns, env_reward=self.reward,
                      env_error=self.error, paused=paused)


@dataclass(slots=True)
class EpisodeRunner:
    """Runs a batch of episodes; `map_steps` steps environments (`rl.envs.pool.EnvPool.map`
    or the same signature), `generate` is the engines'."""
    generate: Generate
    map_steps: Callable
    tool_format: ToolFormat
    tokenizer: object
    max_turns: int
    max_tokens: int
    """Response budget of an episode: model and environment tokens together."""
    max_model_len: int
    """The engines' context: an episode's budget is also at most this minus its prompt."""

    def run(self, prompts: list[list[int]], rows: list[dict], sampling: SamplingParams,
            seed: int, cancelled: Callable[[], bool] | None = None,
            pause_at: int | None = None) -> list[list[Sample]]:
        """`sampling.n` episodes of each prompt (`rows[i]`: its data row), as samples per
        prompt; with `pause_at`, an episode that reaches that many response tokens pauses
        (`Sample.paused`, module docstring). StepAbandoned when `cancelled()` turns true."""
        n = sampling.n
        eps = [_Episode(p, rows[i], self._budget(p)) for i, p in enumerate(prompts)
               for _ in range(n)]
        first = self.generate(prompts, self._turn_sampling(sampling, eps, n, pause_at), seed)
        self._play(eps, [s for group in first for s in group], sampling, seed, cancelled,
                   pause_at)
        return [[e.to_sample(self.tokenizer) for e in eps[i * n:(i + 1) * n]]
                for i in range(len(prompts))]

    def resume(self, samples: list[Sample], rows: list[dict], sampling: SamplingParams,
               seed: int, cancelled: Callable[[], bool] | None = None) -> list[Sample]:
        """Continue the paused episodes `samples` (`rows[i]`: the data row of `samples[i]`)
        with the weights the engines hold now, to their end."""
        eps = [_Episode.from_sample(s, row, self._budget(s.prompt_ids))
               for s, row in zip(samples, rows)]
        self._replay([e for e in eps if e.state is None and e.messages], cancelled)
        active = [e for e in eps if not e.done]
        if active:
            out = self.generate([e.prompt_ids + e.tokens for e in active],
                                self._turn_sampling(sampling, active, 1, None), seed)
            self._play(active, [g[0] for g in out], sampling, seed, cancelled, None)
        return [e.to_sample(self.tokenizer) for e in eps]

    def _budget(self, prompt: list[int]) -> int:
        return min(self.max_tokens, self.max_model_len - len(prompt))

    def _play(self, eps: list[_Episode], turn_samples: list[Sample], sampling: SamplingParams,
              seed: int, cancelled, pause_at: int | None) -> None:
        """Alternate environment steps and engine calls until every episode of `eps` ended or
        paused; `turn_samples`: the first call's sample of each."""
        active = eps
        for round_no in itertools.count(1):
            if round_no > 1:
                out = self.generate([e.prompt_ids + e.tokens for e in active],
                                    self._turn_sampling(sampling, active, 1, pause_at),
                                    turn_seed(seed, round_no))
                turn_samples = [g[0] for g in out]
            for e, s in zip(active, turn_samples):
                e.add_turn(s, sampling.max_new_tokens, pause_at)
            stepping = [e for e in active if not e.paused]
            messages = [self._message(e) for e in stepping]
            outcomes = self.map_steps([(e.row, e.state, m) for e, m in zip(stepping, messages)],
                                      cancelled)
            for e, outcome in zip(stepping, outcomes):
                self._apply(e, outcome, pause_at)
            active = [e for e in eps if not e.done and not e.paused]
            if not active:
                return

    def _turn_sampling(self, sampling: SamplingParams, active: list[_Episode], n: int,
                       pause_at: int | None) -> SamplingParams:
        def room(e: _Episode) -> int:
            r = min(e.budget - len(e.tokens), sampling.max_new_tokens - e.turn_tokens())
            return r if pause_at is None else min(r, pause_at - len(e.tokens))
        most = max((room(e) for e in active), default=sampling.max_new_tokens)
        return dataclasses.replace(sampling, n=n, max_new_tokens=max(1, most))

    def _message(self, e: _Episode) -> dict:
        """The environment's view of `e`'s latest (finished) turn; recorded for a replay."""
        t = e.turns[-1]
        tokens = e.tokens[t["start"]:t["end"]]
        body = tokens[:-1] if e.finish == "stop" else tokens
        text = self.tokenizer.decode(body, skip_special_tokens=False)  # type: ignore[attr-defined]
        calls = self.tool_format.parse(text)
        t["tool_calls"] = [[c.name, c.arguments] for c in calls]
        message = {"text": text, "turn": len(e.turns), "truncated": e.finish == "length",
                   "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in calls]}
        e.messages.append(message)
        return message

    def _apply(self, e: _Episode, outcome: tuple, pause_at: int | None) -> None:
        """The environment's answer to `e`'s latest turn."""
        ok, value = outcome
        if not ok:
            e.end(0.0, e.finish, str(value))
            return
        e.state, (observation, reward, done) = value
        if done:  # the finish reason stays the last turn's ("length" when it was cut)
            e.end(reward, e.finish)
            return
        obs_text = self.tool_format.observation_text(observation)
        obs = self.tokenizer(obs_text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
        if len(e.turns) == self.max_turns or len(e.tokens) + len(obs) >= e.budget:
            e.end(0.0, "length")  # no model turn could follow: the observation is left out
            return
        e.turns[-1]["observation"] = obs_text
        e.tokens += obs
        e.logprobs += [0.0] * len(obs)
        e.mask += [0] * len(obs)
        e.paused = pause_at is not None and len(e.tokens) >= pause_at

    def _replay(self, eps: list[_Episode], cancelled) -> None:
        """Rebuild the environments of `eps` by stepping new instances with their messages; an
        environment that fails, or answers otherwise than it did, fails its episode."""
        for k in range(max((len(e.messages) for e in eps), default=0)):
            todo = [e for e in eps if k < len(e.messages) and not e.done]
            outcomes = self.map_steps([(e.row, e.state, e.messages[k]) for e in todo], cancelled)
            for e, (ok, value) in zip(todo, outcomes):
                if not ok:
                    e.end(0.0, e.finish, f"replaying turn {k + 1}: {value}")
                    continue
                e.state, (observation, _, done) = value
                if done or self.tool_format.observation_text(observation) \
                        != e.turns[k]["observation"]:
                    e.end(0.0, e.finish, f"replaying turn {k + 1} gave another answer than the "
                          "first time: the environment must depend only on its row and messages")

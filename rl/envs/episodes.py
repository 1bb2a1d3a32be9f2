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
"""
from __future__ import annotations

import dataclasses
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
    state: bytes | None = None
    last: Sample | None = None
    reward: float = 0.0
    error: str | None = None
    finish: str = "stop"
    done: bool = False

    def add_turn(self, s: Sample) -> list[int]:
        """Append the model's turn `s` (cut to what the budget leaves); returns its tokens."""
        room = self.budget - len(self.tokens)
        tokens, logprobs = s.response_ids[:room], s.logprobs[:room]
        if not self.spans or self.spans[-1][1] != s.weight_version:
            self.spans.append((len(self.tokens), s.weight_version))
        self.turns.append({"start": len(self.tokens), "end": len(self.tokens) + len(tokens),
                           "tool_calls": [], "observation": None})
        self.tokens += tokens
        self.logprobs += logprobs
        self.mask += [1] * len(tokens)
        self.last = s
        self.finish = s.finish_reason if len(tokens) == len(s.response_ids) else "length"
        return tokens

    def end(self, reward: float, finish: str, error: str | None = None) -> None:
        self.reward, self.finish, self.error, self.done = reward, finish, error, True

    def to_sample(self, tokenizer) -> Sample:
        s = self.last
        assert s is not None
        routing = s.routing
        if routing is not None:  # the last call ran the whole context; cut tokens beyond it
            routing = routing[: len(self.prompt_ids) + len(self.tokens) - 1]
        spans = self.spans if len(self.spans) > 1 else []
        return Sample(prompt_ids=self.prompt_ids, response_ids=self.tokens,
                      text=decode_response(tokenizer, self.tokens, self.finish),
                      logprobs=self.logprobs, finish_reason=self.finish,  # type: ignore[arg-type]
                      weight_version=s.weight_version, version_spans=spans, routing=routing,
                      loss_mask=self.mask, turns=self.turns, env_reward=self.reward,
                      env_error=self.error)


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
            seed: int, cancelled: Callable[[], bool] | None = None) -> list[list[Sample]]:
        """`sampling.n` episodes of each prompt (`rows[i]`: its data row), as samples per
        prompt. StepAbandoned when `cancelled()` turns true."""
        n = sampling.n
        first = self.generate(prompts, self._turn_sampling(sampling, [], n), seed)
        eps = [_Episode(p, rows[i], min(self.max_tokens, self.max_model_len - len(p)))
               for i, p in enumerate(prompts) for _ in range(n)]
        turn_samples = [s for group in first for s in group]
        active = eps
        for turn in range(1, self.max_turns + 1):
            if turn > 1:
                ctx = [e.prompt_ids + e.tokens for e in active]
                out = self.generate(ctx, self._turn_sampling(sampling, active, 1),
                                    turn_seed(seed, turn))
                turn_samples = [g[0] for g in out]
            messages = [self._message(e, s, turn) for e, s in zip(active, turn_samples)]
            outcomes = self.map_steps([(e.row, e.state, m) for e, m in zip(active, messages)],
                                      cancelled)
            for e, outcome in zip(active, outcomes):
                self._apply(e, outcome, turn)
            active = [e for e in eps if not e.done]
            if not active:
                break
        return [[e.to_sample(self.tokenizer) for e in eps[i * n:(i + 1) * n]]
                for i in range(len(prompts))]

    def _turn_sampling(self, sampling: SamplingParams, active: list[_Episode], n: int
                       ) -> SamplingParams:
        room = max((e.budget - len(e.tokens) for e in active), default=self.max_tokens)
        return dataclasses.replace(sampling, n=n,
                                   max_new_tokens=max(1, min(sampling.max_new_tokens, room)))

    def _message(self, e: _Episode, s: Sample, turn: int) -> dict:
        tokens = e.add_turn(s)
        body = tokens[:-1] if e.finish == "stop" else tokens
        text = self.tokenizer.decode(body, skip_special_tokens=False)  # type: ignore[attr-defined]
        calls = self.tool_format.parse(text)
        e.turns[-1]["tool_calls"] = [[c.name, c.arguments] for c in calls]
        return {"text": text, "turn": turn, "truncated": e.finish == "length",
                "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in calls]}

    def _apply(self, e: _Episode, outcome: tuple, turn: int) -> None:
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
        if turn == self.max_turns or len(e.tokens) + len(obs) >= e.budget:
            e.end(0.0, "length")  # no model turn could follow: the observation is left out
            return
        e.turns[-1]["observation"] = obs_text
        e.tokens += obs
        e.logprobs += [0.0] * len(obs)
        e.mask += [0] * len(obs)

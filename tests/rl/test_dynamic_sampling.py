"""DAPO's dynamic sampling and overlong penalty (`rl.dynamic_sampling`): which groups a step
trains on, the refill rounds' prompts and seeds, the bound, the penalty, the config checks (fake
engines, < 1 s). End to end with real engines and resume: tests/rl/loop/test_dynamic_sampling_loop.py."""
import threading
from dataclasses import replace

import pytest

from rl.config import AlgorithmConfig, ConfigError, load_config
from rl.data.sampler import PromptSampler
from rl.dynamic_sampling import fill_batch, overlong_penalties, sample_penalties, zero_spread
from rl.loop import TrainState
from rl.pipeline import RolloutBatch, RolloutPipeline, refill_seed, resume_seed, rollout_seed
from rl.rewards.computer import RewardBreakdown
from rl.rollout.base import Sample, SamplingParams
from rl.signals import StepAbandoned, StopRequest
from tests.helpers.sources import FakeSource

N = 2  # samples per prompt


def _sample(n_tokens: int = 3) -> Sample:
    return Sample(prompt_ids=[1], response_ids=[7] * n_tokens, text="x", logprobs=[-0.1] * n_tokens,
                  finish_reason="stop", weight_version=0)


def _round(step: int, indices: list[int], rewards: list[tuple[float, float]], n_tokens: int = 3,
           ahead: bool = False, seconds: float = 1.0):
    """A scored round: one group of N samples per index, with these rewards."""
    batch = RolloutBatch(step=step, indices=list(indices), ahead=ahead, seconds=seconds,
                         groups=[[_sample(n_tokens) for _ in range(N)] for _ in indices])
    total = [r for pair in rewards for r in pair]
    parts = RewardBreakdown(total=total, correctness=list(total), format=[0.0] * len(total),
                            failed=[False] * len(total), unclosed=[False] * len(total))
    return batch, parts


SPREAD, FLAT1, FLAT0 = (1.0, 0.0), (1.0, 1.0), (0.0, 0.0)


def _alg(**kw) -> AlgorithmConfig:
    return AlgorithmConfig(prompts_per_step=4, **kw)


class _Refills:
    """Answers refill(r, k) from a script of rounds; records the calls."""

    def __init__(self, *rounds):
        self.rounds, self.calls = list(rounds), []

    def __call__(self, round_no: int, k: int):
        self.calls.append((round_no, k))
        indices, rewards = self.rounds.pop(0)
        assert len(indices) == k
        return _round(1, indices, rewards, n_tokens=5, seconds=0.5)


def test_overlong_penalty_is_linear_over_the_buffer():
    assert overlong_penalties([3, 4, 5, 6, 8], 8, 4, 1.0) == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalties([8, 6], 8, 4, 0.5) == [-0.5, -0.25]
    assert overlong_penalties([8, 1], 8, 8, 1.0) == [-1.0, -0.125]
    assert overlong_penalties([8, 8], 8, 0, 1.0) == [0.0, 0.0]  # off


def test_zero_spread_marks_groups_with_equal_rewards():
    groups = [[0, 0], [0, 0], [0, 0]]
    assert zero_spread(groups, [1.0, 1.0, 0.0, 1.0, 0.5, 0.5]) == [True, False, True]


def test_without_dynamic_sampling_the_first_round_is_the_batch():
    first = _round(1, [10, 11, 12, 13], [FLAT1, SPREAD, FLAT0, SPREAD])
    refill = _Refills()
    batch, parts, stats = fill_batch(first, refill, _alg())
    assert batch is first[0] and parts is first[1] and refill.calls == []
    assert (stats.rounds, stats.kept, stats.dropped, stats.padded) == (1, 2, 0, 0)
    assert stats.tokens == 4 * N * 3
    m = stats.metrics(tokens_total=100)
    assert m["sampling/generated_tokens_total"] == 100 and m["sampling/reward_mean"] == 0.5


def test_zero_spread_groups_are_dropped_and_refilled_with_the_shortfall():
    first = _round(1, [10, 11, 12, 13], [FLAT1, SPREAD, FLAT0, (0.0, 1.0)], ahead=True)
    refill = _Refills(([20, 21], [(0.5, 0.0), FLAT1]), ([30], [(1.0, 0.25)]))
    batch, parts, stats = fill_batch(first, refill, _alg(dynamic_sampling=True))
    assert refill.calls == [(1, 2), (2, 1)]  # each round draws what the batch still lacks
    assert batch.indices == [11, 13, 20, 30] and batch.step == 1 and batch.ahead
    assert parts.total == [1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 0.25]
    assert parts.correctness == parts.total and len(parts.failed) == 8
    assert [len(g[0].response_ids) for g in batch.groups] == [3, 3, 5, 5]
    assert all(max(t) != min(t) for t in zip(parts.total[::2], parts.total[1::2]))
    assert batch.seconds == 2.0
    assert (stats.rounds, stats.kept, stats.dropped, stats.padded) == (3, 4, 3, 0)
    assert stats.tokens == 4 * N * 3 + 3 * N * 5  # the dropped groups' tokens too
    assert len(stats.rewards) == 7 * N


def test_a_full_first_round_generates_nothing_more():
    first = _round(1, [10, 11, 12, 13], [SPREAD] * 4)
    refill = _Refills()
    batch, parts, stats = fill_batch(first, refill, _alg(dynamic_sampling=True))
    assert refill.calls == [] and batch.indices == [10, 11, 12, 13]
    assert (stats.rounds, stats.kept, stats.dropped, stats.padded) == (1, 4, 0, 0)


def test_the_bound_pads_the_batch_with_dropped_groups_in_generation_order():
    first = _round(1, [10, 11, 12, 13], [FLAT1, SPREAD, FLAT0, FLAT1])
    refill = _Refills(([20, 21, 22], [FLAT0, FLAT0, SPREAD]))
    batch, parts, stats = fill_batch(first, refill, _alg(dynamic_sampling=True, max_gen_rounds=2))
    assert refill.calls == [(1, 3)]
    assert batch.indices == [11, 22, 10, 12]  # kept, then the first dropped groups
    assert parts.total == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    assert (stats.rounds, stats.kept, stats.dropped, stats.padded) == (2, 2, 3, 2)


class _Generation:
    def __init__(self, groups, hangs=False):
        self.groups, self.hangs, self.seconds = groups, hangs, 0.25

    def wait(self, timeout: float) -> bool:
        if self.hangs:
            threading.Event().wait(timeout)
        return not self.hangs

    def result(self):
        return self.groups


class _Generator:
    def __init__(self, hang=False):
        self.calls, self.hang, self.abandoned = [], hang, False

    def start(self, prompts, sampling, seed, **rows):
        self.calls.append((prompts, seed))
        return _Generation([[_sample()] * sampling.n for _ in prompts], self.hang)

    def finish(self, gen, prompts, sampling, seed, **rows):
        return gen.result(), gen.seconds

    def abandon(self):
        self.abandoned = True


def _pipeline(generator, stop=None):
    cfg = load_config("configs/local.yaml", ["algorithm.prompts_per_step=4", "rollout.n_samples=2",
                                             "algorithm.dynamic_sampling=true", "seed=0"])
    sampling = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=8, seed=0)
    return cfg, RolloutPipeline(cfg, FakeSource(), generator, sampling, stop or StopRequest())


def test_a_refill_round_draws_the_next_prompts_with_its_own_seed():
    gen = _Generator()
    cfg, pipe = _pipeline(gen)
    first = pipe.take(3)
    more = pipe.refill(3, 2, 3)
    order = PromptSampler(10, 0).next_indices(7)
    assert first.indices == order[:4] and more.indices == order[4:]
    assert more.step == 3 and len(more.groups) == 3 and more.seconds == 0.25
    assert [seed for _, seed in gen.calls] == [rollout_seed(cfg.rollout.seed, 3),
                                               refill_seed(cfg.rollout.seed, 3, 2)]


def test_a_stop_during_a_refill_round_gives_it_up():
    stop = StopRequest()
    gen = _Generator(hang=True)
    _, pipe = _pipeline(gen, stop)
    threading.Timer(0.05, stop.request, args=("test",)).start()
    with pytest.raises(StepAbandoned):
        pipe.refill(1, 1, 2)
    assert gen.abandoned


def test_refill_seeds_are_a_stream_of_their_own():
    steps = range(1, 201)
    seeds = ({rollout_seed(0, s) for s in steps} | {resume_seed(0, s) for s in steps}
             | {refill_seed(0, s, r) for s in steps for r in range(1, 9)})
    assert len(seeds) == 200 * 10
    assert refill_seed(0, 5, 1) == refill_seed(0, 5, 1)


@pytest.mark.parametrize("override, message", [
    ("algorithm.max_gen_rounds=1", r"algorithm\.max_gen_rounds: got 1, expected a value >= 2"),
    ("algorithm.overlong_buffer=-1", r"algorithm\.overlong_buffer: got -1, expected a value >= 0"),
    ("algorithm.overlong_buffer=9",
     r"algorithm\.overlong_buffer: got 9, expected a value <= rollout\.max_new_tokens \(8\)"),
    ("algorithm.overlong_penalty_factor=0",
     r"algorithm\.overlong_penalty_factor: got 0\.0, expected a value > 0"),
    ("algorithm.dynamic_sampling=maybe", r"algorithm\.dynamic_sampling"),
])
def test_bad_settings_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/local.yaml", [override])


def test_dynamic_sampling_needs_more_than_one_sample_per_prompt():
    with pytest.raises(ConfigError, match=r"algorithm\.dynamic_sampling: got True, expected false "
                                          r"when rollout\.n_samples is 1"):
        load_config("configs/local.yaml", ["algorithm.dynamic_sampling=true", "rollout.n_samples=1"])
    cfg = load_config("configs/local.yaml", ["algorithm.dynamic_sampling=true",
                                             "algorithm.overlong_buffer=8"])
    assert cfg.algorithm.dynamic_sampling and cfg.algorithm.max_gen_rounds == 4


def test_multi_turn_episodes_are_penalised_against_their_own_budget():
    """An episode's response holds model and environment tokens up to env.max_response_tokens;
    the overlong penalty and its check count against that budget, not one turn's."""
    env = ["env.path=tests.rl.envs.envs:Relay", "env.max_response_tokens=24"]
    cfg = load_config("configs/local.yaml", [*env, "algorithm.overlong_buffer=16"])
    assert cfg.rollout.max_new_tokens == 8 and cfg.response_budget == 24
    assert load_config("configs/local.yaml", []).response_budget == 8
    with pytest.raises(ConfigError, match=r"algorithm\.overlong_buffer: got 25, expected a value "
                                          r"<= env\.max_response_tokens \(24\)"):
        load_config("configs/local.yaml", [*env, "algorithm.overlong_buffer=25"])
    episode = [_text("b" * 20)]  # 20 of 24 tokens: 12 past the 8 the buffer leaves unpenalised
    assert sample_penalties(episode, cfg.response_budget, cfg.algorithm) == [-12 / 16]


def test_defaults_leave_the_algorithm_as_it_was():
    alg = AlgorithmConfig()
    assert not alg.dynamic_sampling and alg.overlong_buffer == 0
    assert replace(alg, dynamic_sampling=True).max_gen_rounds == 4


def test_train_state_of_an_older_checkpoint_loads_without_the_token_count():
    old = {k: v for k, v in TrainState(step=7, generated_tokens=5).state_dict().items()
           if k != "generated_tokens"}
    state = TrainState()
    state.load_state_dict(old)
    assert state.step == 7 and state.generated_tokens == 0
    with pytest.raises(KeyError):
        state.load_state_dict({k: v for k, v in old.items() if k != "step"})


def test_the_console_line_shows_the_rounds():
    from rl.recorder import format_step
    cfg = load_config("configs/local.yaml", ["algorithm.dynamic_sampling=true"])
    line = format_step(cfg, 3, {"sampling/gen_rounds": 3, "sampling/dropped_groups": 5,
                                "sampling/padded_groups": 0})
    assert "rounds 3 dropped 5 padded 0" in line.split(" | ")
    plain = load_config("configs/local.yaml", [])
    assert "rounds" not in format_step(plain, 3, {"sampling/gen_rounds": 1})


class _TextGenerator(_Generator):
    """Prompt [1, i]: an odd i gets responses "a" and "bbbbbbbb" (8 tokens), an even i "a" twice."""

    def start(self, prompts, sampling, seed, **rows):
        self.calls.append((prompts, seed))
        return _Generation([[_text("a"), _text("a" if i % 2 == 0 else "bbbbbbbb")]
                            for _, i in prompts])


def _text(t: str) -> Sample:
    return Sample(prompt_ids=[1], response_ids=[7] * len(t), text=t, logprobs=[-0.1] * len(t),
                  finish_reason="stop", weight_version=0)


class _Rewards:
    """1 for the example's answer, else 0."""

    def score(self, texts, examples, cancelled=None):
        total = [float(t == ex.answer) for t, ex in zip(texts, examples)]
        return RewardBreakdown(total=total, correctness=list(total), format=[0.0] * len(total),
                               failed=[False] * len(total), unclosed=[False] * len(total))


def _run(*overrides):
    """The loop's `BatchScorer` with fake engines, rewards and data (10 prompts, answer "a")."""
    from rl.data.example import Example
    from rl.scoring import BatchScorer
    cfg = load_config("configs/local.yaml", ["algorithm.prompts_per_step=4", "rollout.n_samples=2",
                                             *overrides])
    gen = _TextGenerator()
    source = FakeSource()
    source.train = [Example(prompt=str(i), answer="a") for i in range(10)]
    sampling = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=8, seed=0)
    stop = StopRequest()
    pipeline = RolloutPipeline(cfg, source, gen, sampling, stop)
    return BatchScorer(cfg, source, _Rewards(), None, pipeline, stop, lambda: 0), gen


def test_the_loop_trains_only_on_groups_with_a_reward_spread():
    r, gen = _run("algorithm.dynamic_sampling=true", "algorithm.max_gen_rounds=8")
    scored = r.score(1, r.pipeline.take(1))
    order = PromptSampler(10, 0).next_indices(10)
    odd = [i for i in order if i % 2 == 1]
    assert scored.batch.indices == odd[:4]  # the first four odd prompts, in draw order
    assert all(a != 0 for a in scored.adv)
    drawn = r.source.sampler.state_dict()["position"]
    assert drawn == order.index(odd[3]) + 1 and scored.sampling.rounds == len(gen.calls) > 1
    assert scored.sampling.dropped == drawn - 4


def test_without_dynamic_sampling_the_loop_trains_on_zero_advantage_groups():
    r, gen = _run()
    scored = r.score(1, r.pipeline.take(1))
    assert len(gen.calls) == 1 and scored.batch.indices == PromptSampler(10, 0).next_indices(4)
    assert any(a == 0 for a in scored.adv)


def test_the_overlong_penalty_lowers_long_responses_rewards():
    r, _ = _run("algorithm.overlong_buffer=4", "algorithm.overlong_penalty_factor=0.5")
    scored = r.score(1, r.pipeline.take(1))
    for i, g in zip(scored.batch.indices, range(4)):
        pair = scored.parts.total[2 * g:2 * g + 2]
        assert pair == ([1.0, 1.0] if i % 2 == 0 else [1.0, -0.5])  # 8 of 8 tokens: the factor
    odd = sum(i % 2 for i in scored.batch.indices)
    assert scored.overlong_penalty == pytest.approx(-0.5 * odd / 8)  # reward/overlong_penalty

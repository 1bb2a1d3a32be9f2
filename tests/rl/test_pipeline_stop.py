"""What a stop request does to the rollout pipeline and the reward scoring (fake engines, < 1 s):
it stops waiting, puts the step's batch back, rewinds the sampler past dropped batches."""
import threading
import time
from types import SimpleNamespace

import pytest

from rl.config import RewardConfig, load_config
from rl.data.example import Example
from rl.pipeline import RolloutBatch, RolloutPipeline
from rl.rewards.computer import RewardComputer
from rl.rollout.base import Sample, SamplingParams
from rl.signals import StepAbandoned, StopRequest
from tests.helpers.sources import FakeSource


class _Generation:
    def __init__(self, groups, hangs: bool):
        self.groups, self.hangs, self.seconds = groups, hangs, 0.0

    def wait(self, timeout: float) -> bool:
        if self.hangs:
            time.sleep(timeout)
        return not self.hangs

    def result(self):
        assert not self.hangs
        return self.groups


class _Runtime:
    """Generations finish at once, except those listed in `hangs` (by call number)."""

    def __init__(self, hangs=()):
        self.hangs, self.calls, self.abandoned = set(hangs), 0, False

    def generate_async(self, prompts, sampling, seed):
        self.calls += 1
        groups = [[_sample("length" if sampling.max_new_tokens < 8 else "stop",
                           sampling.max_new_tokens)] * sampling.n for _ in prompts]
        return _Generation(groups, hangs=self.calls in self.hangs)


def _sample(finish: str, n_tokens: int) -> Sample:
    return Sample(prompt_ids=[1, 2], response_ids=[5] * n_tokens, text="x",
                  logprobs=[-0.5] * n_tokens, finish_reason=finish, weight_version=0)


class _Generator:
    def __init__(self, runtime):
        self.runtime = runtime

    def start(self, prompts, sampling, seed):
        return self.runtime.generate_async(prompts, sampling, seed)

    def finish(self, gen, prompts, sampling, seed):
        return gen.result(), gen.seconds

    def abandon(self):
        self.runtime.abandoned = True


def _pipeline(runtime, *overrides, grace: float = 1.0):
    cfg = load_config("configs/local.yaml", ["algorithm.prompts_per_step=2", "rollout.n_samples=2",
                                             f"checkpoint.grace_period_s={grace}", *overrides])
    source = FakeSource()
    ctx = SimpleNamespace(runtime=runtime, sampler=source.sampler)
    sampling = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=8, seed=0)
    stop = StopRequest()
    return RolloutPipeline(cfg, source, _Generator(runtime), sampling, stop), ctx, stop


def _stop_soon(stop: StopRequest, after_s: float = 0.05) -> None:
    threading.Timer(after_s, stop.request, args=("test",)).start()


def test_a_stop_gives_up_an_on_policy_generation_at_once():
    pipe, ctx, stop = _pipeline(_Runtime(hangs={1}))
    _stop_soon(stop)
    t0 = time.monotonic()
    with pytest.raises(StepAbandoned):
        pipe.take(1)
    assert time.monotonic() - t0 < 2.0  # polled every 0.1 s (slack for a loaded machine)
    assert ctx.runtime.abandoned  # the engine is still busy: shut down without waiting for it


def test_a_stop_while_resuming_cut_samples_puts_the_batch_back_as_it_was():
    pipe, ctx, stop = _pipeline(_Runtime(hangs={1}), "algorithm.max_staleness=1",
                                "algorithm.partial_rollouts=resume", "algorithm.partial_tokens=4")
    pending = RolloutBatch(step=3, indices=[4, 5], ahead=True,
                           groups=[[_sample("length", 4)] * 2, [_sample("length", 4)] * 2])
    pipe.pending = [pending]
    _stop_soon(stop)
    with pytest.raises(StepAbandoned):
        pipe.take(3)  # the continuation of the 4-token samples hangs
    assert pipe.pending == []
    pipe.abandon()
    assert [b.to_state() for b in pipe.pending] == [pending.to_state()]


def test_after_training_a_stop_keeps_finished_batches_and_drops_the_rest_within_the_grace():
    pipe, ctx, stop = _pipeline(_Runtime(hangs={2}), "algorithm.max_staleness=2", grace=1.0)
    pipe.launch_ahead(step=1, last_step=10)  # steps 2 (finishes) and 3 (hangs)
    after_step_2_draw = {**ctx.sampler.state_dict(), "position": 2}
    stop.request("test")
    t0 = time.monotonic()
    pipe.collect()
    waited = time.monotonic() - t0
    # Half the grace period is kept for the checkpoint write (none was written yet).
    assert 0.45 < waited < 1.0
    assert [b.step for b in pipe.pending] == [2] and pipe.state_dict()[0]["step"] == 2
    assert ctx.sampler.state_dict() == after_step_2_draw  # step 3's prompts are drawn again
    assert ctx.runtime.abandoned


def test_reward_scoring_stops_when_cancelled():
    rewards = RewardComputer(RewardConfig(function="exact", answer_after=None))
    examples = [Example(prompt="q", answer="7")] * 3
    calls = iter([False, False, True])  # polled while the workers score (and start)
    with pytest.raises(StepAbandoned, match=r"stop requested while scoring \([0-2] of 3"):
        rewards.score(["7", "7", "7"], examples, cancelled=lambda: next(calls))
    assert rewards.score(["7", "8"], examples[:2]).total == [1.0, 0.0]

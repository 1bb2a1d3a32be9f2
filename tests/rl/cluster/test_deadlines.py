"""The driver never waits on a worker group for ever: a call past its deadline
(`cluster.deadlines`) raises CallTimeout naming the call, the ranks and the key; a rank that
dies ends the wait at once, though its peers hang (as in a collective with the dead rank).
Plain processes and Ray actors behave the same."""
import time

import pytest

from rl.cluster.actors import ActorDied, CallTimeout, ProcActor, wait_all
from rl.cluster.facades import RolloutGroup, TrainerGroup
from rl.config import ConfigError, DeadlinesConfig, load_config
from rl.rollout.base import SamplingParams
from tests.rl.cluster.hang_workers import Sleeper


@pytest.fixture
def procs():
    started = []

    def start(*die: bool):
        actors = [ProcActor(Sleeper, d, name=f"trainer-{i}") for i, d in enumerate(die)]
        wait_all([a.ready for a in actors], 60)
        started.extend(actors)
        return actors
    yield start
    for a in started:
        a.kill()


@pytest.fixture(scope="module")
def ray_actors(ray_local):
    ray = pytest.importorskip("ray")

    from rl.cluster.actors import RayActor
    started = []

    def start(*die: bool):
        actors = [RayActor(ray.remote(Sleeper).options(num_cpus=0, max_restarts=0).remote(d),
                           f"trainer-{i}") for i, d in enumerate(die)]
        wait_all([a.call("ping") for a in actors], 120)
        started.extend(actors)
        return actors
    yield start
    for a in started:
        a.kill()


@pytest.fixture(params=["proc", "ray"])
def start(request):
    return request.getfixturevalue("procs" if request.param == "proc" else "ray_actors")


def test_a_call_past_its_deadline_names_the_call_the_ranks_and_the_key(start):
    group = TrainerGroup(start(False, False), DeadlinesConfig(train_s=1.0))
    t0 = time.monotonic()
    with pytest.raises(CallTimeout) as e:
        group.train([], step=3)
    assert time.monotonic() - t0 < 10  # the call itself sleeps 120 s
    assert str(e.value) == ("train_step of step 3 on the trainer group: no answer within 1 s "
                            "(trainer-0, trainer-1 did not answer); raise "
                            "cluster.deadlines.train_s if it can legitimately take longer")


def test_a_dead_rank_fails_the_wait_at_once_while_its_peer_hangs(start):
    group = TrainerGroup(start(False, True))  # rank 0 hangs, rank 1 dies; default deadlines
    t0 = time.monotonic()
    with pytest.raises(ActorDied):
        group.train([], step=1)
    assert time.monotonic() - t0 < 20


def test_a_dead_rank_fails_a_save_at_once(procs):
    group = TrainerGroup(procs(False, True))
    t0 = time.monotonic()
    with pytest.raises(ActorDied):
        group.save("/nonexistent", "ds", {})
    assert time.monotonic() - t0 < 20


def test_a_hung_generation_ends_at_its_deadline(procs):
    rollout = RolloutGroup(procs(False), DeadlinesConfig(generate_s=1.0))
    gen = rollout.generate_async([[1, 2]], SamplingParams(), seed=0)
    assert gen.wait(0.2) is False  # still within its deadline: the pipeline polls on
    t0 = time.monotonic()
    with pytest.raises(CallTimeout, match="generate on the rollout group.*"
                                          "cluster.deadlines.generate_s"):
        while not gen.wait(0.2):
            pass
    assert time.monotonic() - t0 < 5


def test_deadlines_are_validated_naming_the_key():
    with pytest.raises(ConfigError, match=r"cluster\.deadlines\.save_s: got 0\.0, expected a "
                                          r"value > 0"):
        load_config(None, ["cluster.deadlines.save_s=0"])
    assert load_config(None, ["cluster.deadlines.train_s=10"]).cluster.deadlines.train_s == 10

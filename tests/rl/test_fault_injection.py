import pytest

from rl.faults import FaultInjector, parse


def test_parse_and_fire_once():
    assert parse("evaluate:2, probe:0,") == {("evaluate", 2), ("probe", 0)}
    with pytest.raises(ValueError, match="expected POINT:STEP"):
        parse("train:1")

    class Runtime:
        kills = 0

        def kill_engine(self, i):
            assert i == 0
            Runtime.kills += 1

    runtime = Runtime()
    inj = FaultInjector("sync:1")
    inj.at("sync", 2, runtime)
    inj.at("probe", 1, runtime)
    assert Runtime.kills == 0
    inj.at("sync", 1, runtime)
    inj.at("sync", 1, runtime)
    assert Runtime.kills == 1


def test_trainer_kill_fires_once_on_the_last_rank_in_its_life():
    class Runtime:
        trainer = type("T", (), {"num_ranks": 3})()
        killed: list[int] = []

        def kill_trainer(self, rank):
            Runtime.killed.append(rank)

    runtime = Runtime()
    inj = FaultInjector("", "2@1")
    inj.before_train(2, 0, runtime)
    inj.before_train(1, 1, runtime)
    assert Runtime.killed == []
    inj.before_train(2, 1, runtime)
    inj.before_train(2, 1, runtime)
    assert Runtime.killed == [2]

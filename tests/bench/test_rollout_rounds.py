"""bench.rollout's rounds: every engine is called once per round, the order rotated, so that
the ratios docs/performance.md reports pair calls made side by side."""
from types import SimpleNamespace

import pytest

from bench import rollout


class FakeEngine:
    """Records its calls in a shared log; each generate call moves the shared clock (the
    patched perf_counter) by `secs`."""

    def __init__(self, name, log, clock, secs):
        self.name, self.log, self.clock, self.secs = name, log, clock, secs

    def generate(self, prompts, sampling):
        self.log.append((self.name, sampling.max_new_tokens))
        self.clock[0] += self.secs
        return [[SimpleNamespace(response_ids=[0] * sampling.max_new_tokens)] for _ in prompts]


def _engines(monkeypatch, secs):
    clock = [0.0]
    monkeypatch.setattr(rollout.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(rollout, "sync", lambda: None)
    log = []
    return {name: FakeEngine(name, log, clock, s) for name, s in secs.items()}, log


def test_each_round_calls_every_engine_once_rotating_the_order(monkeypatch):
    engines, log = _engines(monkeypatch, {"a": 0.1, "b": 0.2, "c": 0.3})
    times = rollout.run_rounds(engines, [[1, 2]], 5, min_seconds=0.0, min_rounds=3)
    assert log[:3] == [("a", 3), ("b", 3), ("c", 3)]       # warm-ups first, 3 tokens
    timed = [n for n, new in log[3:]]
    assert all(new == 5 for _, new in log[3:])
    assert timed == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert {n: len(t) for n, t in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert times["b"] == pytest.approx([0.2, 0.2, 0.2])     # each call's own duration


def test_rounds_go_on_until_every_engine_has_its_seconds_at_most_five(monkeypatch):
    engines, _ = _engines(monkeypatch, {"fast": 0.1, "slow": 0.5})
    times = rollout.run_rounds(engines, [[1]], 2, min_seconds=0.35, min_rounds=1)
    assert len(times["fast"]) == len(times["slow"]) == 4     # fast needs 4 x 0.1 >= 0.35
    times = rollout.run_rounds(engines, [[1]], 2, min_seconds=10.0, min_rounds=1)
    assert len(times["fast"]) == 5                           # capped

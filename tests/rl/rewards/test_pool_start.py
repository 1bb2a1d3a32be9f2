"""The reward pool's start timeout covers the workers' start, not the time the pool sat idle
before its first `map` (an SFT warm start of more than START_TIMEOUT_S came between the two)."""
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from rl.rewards import RewardPool
from rl.rewards import pool as pool_module

REPO = Path(__file__).resolve().parents[3]


def test_workers_started_long_before_the_first_map_score_it(monkeypatch):
    offset = 0.0
    clock = SimpleNamespace(monotonic=lambda: time.monotonic() + offset)
    monkeypatch.setattr(pool_module, "time", clock)  # the pool's clock only
    pool = RewardPool("exact", 2, 60)
    try:
        offset = pool_module.START_TIMEOUT_S + 60  # the workers started that long ago
        calls = [("4", "4", {}), ("5", "4", {}), ("4", "4", {})]
        assert [ok for ok, _ in pool.map(calls)] == [True, True, True]
    finally:
        pool.close()


def test_a_worker_that_never_gets_ready_is_still_a_fault(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    monkeypatch.setattr(pool_module, "START_TIMEOUT_S", 0.5)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="was not ready"):
        RewardPool("tests.rl.rewards.slow_import_reward_plugin:fn", 1, 60)
    assert time.monotonic() - t0 < 30

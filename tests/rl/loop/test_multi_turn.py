"""Multi-turn episodes in the real loop (2 DeepSpeed ZeRO-3 ranks, the HF engine, environment
workers): environment failures counted while the run goes on, exact resume after a stop in the
middle of a multi-turn step, and bounded staleness with episodes generated ahead, paused at the
interrupt budget and resumed with the new weights (through a checkpoint too)."""
import threading

import numpy as np
import pytest

from tests.rl.loop.conftest import (COMPARED, assert_same_run, make_cfg, pending_batches,
                                    read_metrics, run_stopped_after, wait_for)

pytestmark = pytest.mark.slow

MULTI = ["rollout.engine=hf", "env.path=tests.rl.envs.envs:Relay", "env.max_turns=2",
         "env.max_response_tokens=24", "env.step_timeout_s=3", "env.num_workers=1"]
ENV_KEYS = ("env/failures", "env/turns_mean", "env/env_tokens_mean", "env/tool_call_rate",
            "eval/turns_mean")


@pytest.fixture(scope="module")
def multi_reference(tmp_path_factory, ray_local):
    from rl.loop import run
    cfg = make_cfg(tmp_path_factory.mktemp("runs"), "multi", *MULTI)
    return cfg, run(cfg)


def test_multi_turn_run_trains_on_episodes_and_counts_env_failures(multi_reference):
    from rl.metrics.trajectories import TrajectoryReader
    cfg, result = multi_reference
    assert result.status == "done" and result.step == 6
    metrics = read_metrics(cfg.run_dir)
    # Relay answers every first turn: most episodes take two turns, with "[result: ok]" between
    assert all(1 < m["env/turns_mean"] <= 2 for m in metrics)
    assert all(m["env/env_tokens_mean"] > 0 for m in metrics)
    failures = [m["env/failures"] for m in metrics]
    assert failures == sorted(failures) and failures[-1] > 0  # counted, and the run went on
    with TrajectoryReader(cfg.run_dir / "trajectories.h5") as r:
        rows = [r.row(i) for i in range(r.num_rows)]
    two = [row for row in rows if len(row["episode"]["turns"]) == 2]
    assert two and all(0 in row["loss_mask"] for row in two)
    failed = [row for row in rows if row["episode"]["error"]]
    assert len(failed) == failures[-1] and all(row["reward"] == 0 for row in failed)


def test_stop_in_a_multi_turn_step_resumes_to_the_same_run(multi_reference, tmp_path,
                                                           monkeypatch):
    from rl.loop import run
    from rl.signals import StopRequest
    ref_cfg, _ = multi_reference
    marker = tmp_path / "turn2_calls"
    monkeypatch.setenv("RL_TEST_ENV_MARKER", str(marker))
    monkeypatch.setenv("RL_TEST_ENV_PAUSE_AT", "100")  # in step 2's episodes (or step 3's)
    cfg = make_cfg(tmp_path, "multi", *MULTI)
    stop = StopRequest()

    def calls():
        return len(marker.read_text().splitlines()) if marker.exists() else 0
    th = threading.Thread(target=lambda: (wait_for(lambda: calls() >= 100, 900, "call 100"),
                                          stop.request("test")), daemon=True)
    th.start()
    first = run(cfg, stop=stop)
    assert first.status == "stopped" and first.step < 6
    stopped_metrics = read_metrics(cfg.run_dir)
    assert len(stopped_metrics) == first.step  # the step the stop landed in was abandoned
    monkeypatch.delenv("RL_TEST_ENV_PAUSE_AT")
    second = run(cfg)
    assert second.status == "done" and second.step == 6
    assert_same_run(cfg.run_dir, ref_cfg.run_dir, (*COMPARED, *ENV_KEYS))


ASYNC = ["algorithm.max_staleness=1", "algorithm.partial_rollouts=resume",
         "algorithm.partial_tokens=4", "algorithm.dynamic_sampling=true",
         "algorithm.max_gen_rounds=2", "algorithm.overlong_buffer=4"]


@pytest.fixture(scope="module")
def async_reference(tmp_path_factory, ray_local):
    from rl.loop import run
    cfg = make_cfg(tmp_path_factory.mktemp("runs"), "multi-async", *MULTI, *ASYNC)
    return cfg, run(cfg)


def test_multi_turn_with_bounded_staleness_and_dynamic_sampling(async_reference):
    """Episodes generated ahead, paused after 4 response tokens (in turn 1, or after its short
    answer and the observation) and finished with the new weights (partial rollouts); refill
    rounds of episodes for groups without a reward spread (generated with the current weights:
    a refilled step's staleness can be 0)."""
    from rl.metrics.trajectories import TrajectoryReader
    cfg, result = async_reference
    assert result.status == "done" and result.step == 6
    metrics = read_metrics(cfg.run_dir)
    assert [m["rollout/staleness_max"] for m in metrics] == [0, 1, 1, 1, 1, 1]
    assert metrics[0]["rollout/resumed_frac"] == 0
    assert any(m["rollout/resumed_frac"] > 0 for m in metrics[1:])
    with TrajectoryReader(cfg.run_dir / "trajectories.h5") as r:
        rows = [r.row(i) for i in range(r.num_rows)]
    resumed = [row for row in rows if len(row["version_spans"]) == 2]
    assert resumed and all(row["version_spans"][1][0] >= 4 for row in resumed)
    assert all(len(row["loss_mask"]) == row["response_length"] for row in resumed)
    # a second round happens exactly when the first dropped a group
    assert all((m["sampling/gen_rounds"] == 2) == (m["sampling/dropped_groups"] > 0)
               for m in metrics)
    assert all(m["sampling/kept_groups"] + m["sampling/padded_groups"]
               == cfg.algorithm.prompts_per_step for m in metrics)
    assert all(1 < m["env/turns_mean"] <= 2 for m in metrics)
    assert metrics[-1]["env/failures"] > 0


def test_stop_with_paused_episodes_resumes_to_the_same_run(async_reference, tmp_path):
    """A stop once step 1 is logged: wherever it lands (finishing step 2's paused episodes,
    training, or collecting step 3's), the checkpoint holds episodes generated ahead, paused
    and without their environments; the resumed run rebuilds each environment from its
    messages and runs the uninterrupted run's steps."""
    from rl.loop import run
    ref_cfg, _ = async_reference
    cfg = make_cfg(tmp_path, "multi-async", *MULTI, *ASYNC)
    first = run_stopped_after(cfg, 1)
    assert first.status == "stopped" and 1 <= first.step < 6
    pending = [s for b in pending_batches(cfg.run_dir) for s in b.samples()]
    paused = [s for s in pending if s.paused is not None]
    assert paused and all(s.paused["env_state"] is None for s in paused)
    assert any(s.paused["messages"] for s in paused)  # their environments are replayed
    second = run(cfg)
    assert second.status == "done" and second.step == 6
    assert_same_run(cfg.run_dir, ref_cfg.run_dir, (*COMPARED, *ENV_KEYS, "rollout/resumed_frac"))
    # every episode as the uninterrupted run had it (an environment not rebuilt ends a resumed
    # episode otherwise: Relay would answer its turn 2 as a turn 1)
    got, want = (episode_columns(d) for d in (cfg.run_dir, ref_cfg.run_dir))
    for key in want:
        assert np.array_equal(got[key], want[key]), key


def episode_columns(run_dir) -> dict:
    from rl.metrics.trajectories import TrajectoryReader
    with TrajectoryReader(run_dir / "trajectories.h5") as r:
        return {k: r.column(k) for k in ("step", "reward", "finish_reason", "response_length")}

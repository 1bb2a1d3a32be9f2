"""A reward plugin that raises inside the loop: the run goes on, the failed samples score 0 and
are counted in `reward/failures`. tests.rl.loop.plugins:raises_sometimes raises on responses that
start with "1" and gives 0 otherwise; with a format reward on top, a sample that did not fail
scores format_weight x format, one that failed 0 whatever its format."""
import pytest

from tests.rl.loop.conftest import make_cfg, read_metrics

pytestmark = pytest.mark.slow
FORMAT_WEIGHT = 0.5


def test_raising_reward_plugin_scores_zero_counts_failures_and_the_run_goes_on(tmp_path, ray_local):
    from rl.loop import run
    from rl.metrics.trajectories import TrajectoryReader
    from rl.models.loading import load_tokenizer
    from rl.rewards.verifiers import format_reward
    from rl.rollout.base import decode_response
    from rl.sft import warm_start_dir
    cfg = make_cfg(tmp_path, "reward-fails",
                   "reward.function=tests.rl.loop.plugins:raises_sometimes",
                   f"reward.format_weight={FORMAT_WEIGHT}", "rollout.engine=hf", "num_steps=2",
                   "eval.every=0", "checkpoint.every=0")
    result = run(cfg)
    assert result.status == "done" and result.step == 2
    tok = load_tokenizer(warm_start_dir(cfg))
    with TrajectoryReader(cfg.run_dir / "trajectories.h5") as r:
        rows = [r.row(i) for i in range(r.num_rows)]
    texts = [decode_response(tok, row["response_ids"].tolist(), row["finish_reason"])
             for row in rows]
    raised = [t.strip().startswith("1") for t in texts]
    fmt = [format_reward(t, cfg.reward.response_format) for t in texts]
    assert [row["reward"] for row in rows] == [0.0 if x else FORMAT_WEIGHT * f
                                               for x, f in zip(raised, fmt)]
    # Both outcomes occur among well-formed answers: a failure's 0 is the failure's doing.
    assert any(x and f == 1 for x, f in zip(raised, fmt))
    assert any(not x and f == 1 for x, f in zip(raised, fmt))
    # reward/failures counts them, cumulatively over the run.
    metrics = read_metrics(cfg.run_dir)
    per_step = [sum(x for x, row in zip(raised, rows) if row["step"] == s) for s in (1, 2)]
    assert [m["reward/failures"] for m in metrics] == [per_step[0], per_step[0] + per_step[1]]

"""A stop skips the step's evaluation (checkpoint first); the resumed run evaluates the restored
weights at its start and completes that step's record, so metrics.jsonl equals an uninterrupted
run's."""
import json

from rl.faults import FaultInjector
from rl.run_state import DriverState, RunContext


def test_resumed_run_completes_the_skipped_evaluation(tmp_path):
    rows = [{"step": s, "reward/mean": 0.1 * s} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ctx = RunContext.__new__(RunContext)  # only what the pending evaluation touches
    ctx.run_dir, ctx.state, ctx.faults = tmp_path, DriverState(step=3, eval_pending=3), FaultInjector("")
    evaluated, logged = [], []
    ctx.evaluate = lambda step: evaluated.append(step) or {"eval/pass1": 0.5}
    ctx.log = lambda step, metrics: logged.append((step, metrics))
    ctx._evaluate_pending()
    got = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert got == rows[:2] + [{**rows[2], "eval/pass1": 0.5}]
    assert evaluated == [3] and logged == [(3, {"eval/pass1": 0.5})]
    assert ctx.state.eval_pending is None

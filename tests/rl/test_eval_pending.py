"""A stop skips the step's evaluation (checkpoint first); the resumed run evaluates the restored
weights at its start and completes that step's record, so metrics.jsonl equals an uninterrupted
run's (rewritten once: the rewind to the checkpoint and the completion together)."""
import json

from rl.config import load_config
from rl.evaluate import Evaluator
from rl.recorder import Recorder


def test_resumed_run_completes_the_skipped_evaluation(tmp_path):
    rows = [{"step": s, "reward/mean": 0.1 * s} for s in (1, 2, 3, 4)]
    cfg = load_config(None, [f"output_dir={tmp_path}", "name=run"])
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evaluator = Evaluator(cfg, source=None, rollout=None, publisher=None)
    evaluator.load_state_dict({"last_eval": {}, "eval_pending": 3})
    evaluated = []
    evaluator.evaluate = lambda step: evaluated.append(step) or {"eval/pass1": 0.5}
    owed = evaluator.evaluate_pending()
    assert owed == (3, {"eval/pass1": 0.5}) and evaluated == [3]
    assert evaluator.pending is None and evaluator.evaluate_pending() is None
    # step 4 was written by a life that did not checkpoint it: dropped in the same rewrite
    Recorder(cfg).rewind_jsonl(3, complete=owed)
    got = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert got == rows[:2] + [{**rows[2], "eval/pass1": 0.5}]

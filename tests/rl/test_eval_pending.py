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


def test_a_stop_while_the_evaluation_scores_leaves_it_pending(tmp_path):
    """A reward function that hangs on the held-out responses does not hold the stop back: the
    evaluation gives up, stays owed, and the resumed run does it."""
    import time
    from types import SimpleNamespace

    from rl.data import Example
    from rl.rollout.base import Sample
    cfg = load_config(None, [f"output_dir={tmp_path}", "name=run", "eval.pass_k=1",
                             "reward.function=tests.rl.rewards.user_reward_plugins:scripted",
                             "reward.num_workers=1", "reward.verify_timeout_s=600"])

    class Rollout:  # every held-out response asks the plugin to hang
        def generate(self, prompt_ids, params, seed):
            return [[Sample(prompt_ids=p, response_ids=[1], text="hang", logprobs=[0.0],
                            finish_reason="stop", weight_version=0)] for p in prompt_ids]

    source = SimpleNamespace(eval_ids=[[1], [2]], eval_set=[Example(prompt="q", answer="1")] * 2,
                             tokenizer=None)
    publisher = SimpleNamespace(retry=lambda point, fn, step=None: fn())
    evaluator = Evaluator(cfg, source, Rollout(), publisher)
    try:
        asked = time.monotonic() + 0.5
        assert evaluator.evaluate(4, cancelled=lambda: time.monotonic() > asked) == {}
        assert time.monotonic() - asked < 2.0
        assert evaluator.pending == 4 and evaluator.last == {}
    finally:
        evaluator.rewards.close()

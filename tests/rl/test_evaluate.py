"""`rl.evaluate.evaluate` on an empty eval set (evaluation off)."""
from rl.config import RewardConfig
from rl.evaluate import evaluate
from rl.rewards.computer import RewardComputer


def test_empty_eval_set_reports_nothing_and_generates_nothing():
    # runtime=None: any generation attempt would raise; an empty set must not report 0 accuracy.
    rewards = RewardComputer(RewardConfig(function="exact", answer_after=None))
    out = evaluate(None, [], [], rewards, None, max_new_tokens=4, pass_k=4, temperature=1.0,
                   seed=0)
    assert out == {}

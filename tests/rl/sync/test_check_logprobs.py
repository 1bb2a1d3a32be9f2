"""`sync.check_logprobs`: after an update the trainer and every engine score one probe sequence;
a difference above `sync.check_logprobs_tol` stops the run. `WeightPublisher.check_logprobs` against
a runtime whose engines answer with chosen offsets from the trainer's log-probs (the real
scoring is covered by the loop tests, where the check passes)."""
from types import SimpleNamespace

import pytest

from rl.config import load_config
from rl.data import Example
from rl.faults import FaultInjector
from rl.models.tokenizer import build_char_tokenizer
from rl.data.source import PromptSource
from rl.publisher import WeightPublisher


class OffsetRuntime:
    """Trainer log-probs -0.1, -0.2, ...; engine i reports them shifted by offsets[i] at the
    last token. Records what it was asked to score."""

    def __init__(self, *offsets):
        self.offsets, self.asked = offsets, []

        self.trainer = SimpleNamespace(score=self.score_trainer)
        self.rollout = SimpleNamespace(score=self.score_engines)

    def score_trainer(self, prompt_ids, response_ids):
        self.asked.append((prompt_ids, response_ids))
        return [[-0.1 * (k + 1) for k in range(len(r))] for r in response_ids]

    def score_engines(self, prompt_ids, response_ids):
        ref = self.score_trainer(prompt_ids, response_ids)
        return [[row[:-1] + [row[-1] + off] for row in ref] for off in self.offsets]


def context(runtime, tol):
    source = PromptSource.__new__(PromptSource)  # the probe needs only these, not a dataset
    source.tokenizer = build_char_tokenizer()
    source.eval_set, source.eval_ids = [Example(prompt="2+3=", answer="5", meta={})], [[7, 8, 9]]
    source.train, source.train_ids = [], []
    cfg = load_config(None, [f"sync.check_logprobs_tol={tol}"])
    publisher = WeightPublisher(cfg, runtime, source.probe(), lambda: 1, FaultInjector(""))
    return publisher


def test_engines_within_tolerance_pass_and_the_worst_difference_is_returned():
    runtime = OffsetRuntime(2e-4, -6e-4)
    ctx = context(runtime, 1e-3)
    assert ctx.check_logprobs() == pytest.approx(6e-4)
    # The probe: the first eval prompt, its answer's tokens and EOS.
    tok = build_char_tokenizer()
    assert runtime.asked[0] == ([[7, 8, 9]], [tok("5", add_special_tokens=False)["input_ids"]
                                              + [tok.eos_token_id]])


def test_one_engine_above_tolerance_stops_the_run():
    ctx = context(OffsetRuntime(1e-5, 2.5e-3), 1e-3)
    with pytest.raises(RuntimeError, match=r"differ from the trainer's by 2\.50e-03 \(> "
                                           r"sync\.check_logprobs_tol 1e-03\): the weights did not"):
        ctx.check_logprobs()

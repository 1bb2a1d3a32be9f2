"""The SFT warm start's greedy accuracy scores as RL does: decoded as the engines decode (the
reasoning markers kept, even where the tokenizer flags them special), each row cut at its EOS,
and with DeepSeek-V4 thinking only the answer after `</think>` counts."""
import pytest
import torch

from rl.config import load_config
from rl.data import Example
from rl.models.loading import load_tokenizer
from rl.sft import greedy_accuracy
from tests.helpers.v4_published import mark_special, write_published_tokenizer

EOS = "<｜end▁of▁sentence｜>"
# Scored whole, math-verify would take the last number of each: 2 of 3 right.
REPLIES = ["41 or 42?</think>42",      # the answer after the reasoning: right
           "42 at first</think>41",    # right only in the reasoning
           "42"]                       # never closed the reasoning


class Replay:
    """Stands in for the model: `generate` appends the next scripted reply to each prompt,
    left-padded prompts and right-padded replies, as transformers' `generate` returns them."""

    def __init__(self, tok, replies):
        self.tok, self.replies = tok, replies

    def eval(self):
        return self

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, **kwargs):
        rows = [self.tok.encode(r + EOS, add_special_tokens=False) for r in self.replies]
        width = max(map(len, rows))
        out = torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows])
        return torch.cat([input_ids, out], dim=1)


@pytest.mark.parametrize("flags", ["published", "special"])
def test_greedy_accuracy_scores_the_answer_after_the_reasoning(tmp_path, flags):
    write_published_tokenizer(tmp_path)
    if flags == "special":
        mark_special(tmp_path, "</think>")
    tok = load_tokenizer(tmp_path)
    cfg = load_config(None, [f"model.path={tmp_path}", "data.prompt_format=deepseek_v4",
                             "reward.function=math"])
    examples = [Example(prompt=f"What is {i}+42-{i}?", answer="42") for i in range(3)]
    assert greedy_accuracy(Replay(tok, REPLIES), tok, cfg, examples, max_new_tokens=16) == 1 / 3

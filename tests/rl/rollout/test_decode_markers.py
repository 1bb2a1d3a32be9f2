"""Response text keeps DeepSeek's reasoning markers, whichever way a tokenizer flags them:
`reward.answer_after` splits responses at `</think>`, and a `skip_special_tokens` decode drops
a marker its tokenizer calls special. DeepSeek's does not (the published-layout tokenizer here
adds them as plain tokens); the flagged variant stands for a tokenizer that does."""
from types import SimpleNamespace

import pytest

from rl.models.loading import load_tokenizer
from rl.rollout.base import decode_response, special_markers
from tests.helpers.v4_published import mark_special, write_published_tokenizer

EOS = "<｜end▁of▁sentence｜>"
TEXT = "<think>2 + 2 = 4, so</think> 4"


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """{'published': DeepSeek's flags, 'special': <think> and </think> flagged special}."""
    out = {}
    for name in ("published", "special"):
        path = tmp_path_factory.mktemp(name)
        write_published_tokenizer(path)
        if name == "special":
            mark_special(path, "<think>", "</think>")
        out[name] = load_tokenizer(path)
    return out


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("name", ["published", "special"])
def test_markers_survive_decoding_and_special_tokens_do_not(tokenizers, name):
    tok = tokenizers[name]
    response = ids(tok, TEXT) + ids(tok, EOS)
    assert decode_response(tok, response, "stop") == TEXT
    assert decode_response(tok, ids(tok, "a" + EOS + "</think>b"), "length") == "a</think>b"


def test_only_a_tokenizer_that_drops_the_markers_needs_the_splice(tokenizers):
    assert special_markers(tokenizers["published"]) == {}
    special = tokenizers["special"]
    assert sorted(special_markers(special).values()) == ["</think>", "<think>"]
    # What a plain skip_special_tokens decode (HF's, vLLM's) makes of it:
    assert special.decode(ids(special, TEXT), skip_special_tokens=True) == "2 + 2 = 4, so 4"


def test_vllm_text_gets_the_marker_back(tokenizers):
    """vLLM decodes inside the engine with skip_special_tokens; `_sample` re-decodes a response
    holding a marker that decode dropped."""
    from rl.rollout.vllm_engine import VLLMEngine
    tok = tokenizers["special"]
    engine = object.__new__(VLLMEngine)
    engine.tokenizer, engine.special_markers = tok, special_markers(tok)
    engine.weight_version = 3
    tokens = ids(tok, TEXT) + ids(tok, EOS)
    completion = SimpleNamespace(
        token_ids=tokens, text=tok.decode(tokens, skip_special_tokens=True), finish_reason="stop",
        logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in tokens])
    sample = engine._sample([1, 2], completion)
    assert sample.text == TEXT and sample.response_ids == tokens
    assert sample.logprobs == [-0.5] * len(tokens) and sample.weight_version == 3

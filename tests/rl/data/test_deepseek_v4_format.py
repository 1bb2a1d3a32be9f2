"""data.prompt_format: deepseek_v4 writes what DeepSeek's published V4 encoding writes.

The expected strings were produced by running `encode_messages` of DeepSeek's
`encoding/encoding_dsv4.py` (huggingface.co/deepseek-ai/DeepSeek-V4-Flash, the revision
60d8d70770c6776ff598c94bb586a859a38244f1 that secondary sources pin; read through its verbatim
copy in github.com/flagos-ai/DeepSeek-V4-FlagOS, commit 5502249817d1e3acdf6037ac8c33810a030e1ee0,
`encoding_dsv4.py`), its encode path transcribed unchanged, with the default
`add_default_bos_token=True, drop_thinking=True`, e.g.
`encode_messages([{"role": "system", ...}, {"role": "user", ...}], thinking_mode="thinking")`.
vLLM 0.32's later revision of that file (vllm/tokenizers/deepseek_v4_encoding.py) gave the same
strings; for `max` only after mapping the effort name (its `high` prefix is the published `max`).
"""
import pytest

from rl.config import ConfigError, DataConfig, DeepSeekV4PromptConfig, load_config
from rl.data import Example, format_prompt
from rl.data.datasets import prompt_ids
from rl.data.deepseek_v4 import SPECIAL_TOKENS
from rl.data.source import PromptSource
from rl.models.tokenizer import build_char_tokenizer
from rl.sft import _encode
from tests.helpers.v4_published import write_published_tokenizer

USER = "What is 37+5? Put the final answer in \\boxed{}."
SYSTEM = "You are a careful mathematician."
MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very thorough "
    "in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and "
    "adversarial scenarios.\nExplicitly write out your entire deliberation process, documenting "
    "every intermediate step, considered alternative, and rejected hypothesis to ensure "
    "absolutely no assumption is left unchecked.\n\n")
# (system, thinking_mode, reasoning_effort) as passed to DeepSeek's encode_messages -> its output
EXPECTED = {
    (None, "thinking", None):
        "<｜begin▁of▁sentence｜><｜User｜>What is 37+5? Put the final answer in \\boxed{}."
        "<｜Assistant｜><think>",
    (None, "chat", None):
        "<｜begin▁of▁sentence｜><｜User｜>What is 37+5? Put the final answer in \\boxed{}."
        "<｜Assistant｜></think>",
    (SYSTEM, "thinking", None):
        "<｜begin▁of▁sentence｜>You are a careful mathematician.<｜User｜>What is 37+5? Put the "
        "final answer in \\boxed{}.<｜Assistant｜><think>",
    (SYSTEM, "chat", None):
        "<｜begin▁of▁sentence｜>You are a careful mathematician.<｜User｜>What is 37+5? Put the "
        "final answer in \\boxed{}.<｜Assistant｜></think>",
    (None, "thinking", "high"):
        "<｜begin▁of▁sentence｜><｜User｜>What is 37+5? Put the final answer in \\boxed{}."
        "<｜Assistant｜><think>",
    (None, "thinking", "max"):
        "<｜begin▁of▁sentence｜>" + MAX_PREFIX + "<｜User｜>What is 37+5? Put the final answer in "
        "\\boxed{}.<｜Assistant｜><think>",
    (SYSTEM, "thinking", "max"):
        "<｜begin▁of▁sentence｜>" + MAX_PREFIX + "You are a careful mathematician.<｜User｜>What is "
        "37+5? Put the final answer in \\boxed{}.<｜Assistant｜><think>",
}


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4_tokenizer")
    return path, write_published_tokenizer(path)


@pytest.fixture(scope="module")
def v4_tok(v4_dir):
    from rl.models.loading import load_tokenizer
    return load_tokenizer(v4_dir[0])


def _cfg(system, mode, effort) -> DataConfig:
    options = DeepSeekV4PromptConfig(thinking=mode == "thinking",
                                     reasoning_effort=effort or "high")
    return DataConfig(prompt_format="deepseek_v4", system_prompt=system, deepseek_v4=options)


@pytest.mark.parametrize("case", list(EXPECTED), ids=lambda c: "-".join(map(str, c[1:])) +
                         ("-system" if c[0] else ""))
def test_text_equals_deepseeks_encoding(v4_tok, case):
    assert format_prompt(Example(USER, "42"), v4_tok, _cfg(*case)) == EXPECTED[case]


def test_markers_are_single_ids_and_bos_comes_once(v4_tok, v4_dir):
    ids = v4_dir[1]
    cfg = load_config(None, ["model.path=/v4", "data.prompt_format=deepseek_v4"]).data
    got = prompt_ids(Example("1+1=", "2"), v4_tok, cfg)
    byte = {c: v4_tok.convert_tokens_to_ids(c) for c in "1+="}
    assert got == [ids["<｜begin▁of▁sentence｜>"], ids["<｜User｜>"], byte["1"], byte["+"],
                   byte["1"], byte["="], ids["<｜Assistant｜>"], ids["<think>"]]
    for marker in SPECIAL_TOKENS:
        assert len(v4_tok(marker, add_special_tokens=False)["input_ids"]) == 1, marker
    # The response side: EOS ends generation, and decoding keeps </think> for the reward.
    assert v4_tok.eos_token_id == ids["<｜end▁of▁sentence｜>"]
    assert "</think>" in v4_tok.decode([ids["</think>"], byte["1"]], skip_special_tokens=True)


def test_tokenizer_without_v4_markers_is_a_config_error():
    cfg = DataConfig(prompt_format="deepseek_v4")
    with pytest.raises(ConfigError, match=r"data\.prompt_format: got 'deepseek_v4', but the "
                                          r"tokenizer \(\w+\) splits <｜begin▁of▁sentence｜> into "
                                          r"\d+ tokens; expected a DeepSeek-V4 tokenizer"):
        format_prompt(Example("1+1=", "2"), build_char_tokenizer(), cfg)


def test_chat_template_on_the_published_tokenizer_suggests_deepseek_v4(v4_tok):
    for cfg, key in ((DataConfig(chat_template=True), r"data\.chat_template: got True"),
                     (DataConfig(prompt_format="chat_template"),
                      r"data\.prompt_format: got 'chat_template'")):
        with pytest.raises(ConfigError, match=key + r", but the tokenizer \(\w+\) has no chat "
                                                    r"template; .*deepseek_v4 for DeepSeek-V4"):
            format_prompt(Example("q", "1"), v4_tok, cfg)


def test_sft_rl_and_eval_encode_v4_prompts_identically(v4_tok, v4_dir):
    cfg = load_config(None, [f"model.path={v4_dir[0]}", "data.prompt_format=deepseek_v4",
                             "data.synthetic.num_train=20", "data.synthetic.num_eval=5"])
    source = PromptSource(cfg, v4_tok)
    assert [p for p, _ in _encode(v4_tok, cfg, source.train)] == source.train_ids
    assert [p for p, _ in _encode(v4_tok, cfg, source.eval_set)] == source.eval_ids
    head, tail = v4_dir[1]["<｜begin▁of▁sentence｜>"], v4_dir[1]["<think>"]
    assert all(p[0] == head and p[1] != head and p[-1] == tail
               for p in source.train_ids + source.eval_ids)

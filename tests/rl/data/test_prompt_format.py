"""format_prompt with a real (tiny, offline) Hugging Face tokenizer and its chat template, and
the data.prompt_format settings (DeepSeek-V4's format: test_deepseek_v4_format.py)."""
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from rl.config import ConfigError, DataConfig, load_config
from rl.data import Example, format_prompt
from rl.data.datasets import prompt_ids
from rl.models.tokenizer import build_char_tokenizer

REPO = Path(__file__).resolve().parents[3]

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
        unk_token="<unk>")
    tok.chat_template = TEMPLATE
    return tok


def test_raw_prompt_without_chat_template(tokenizer):
    assert format_prompt(Example("37+5=", "42"), tokenizer, DataConfig()) == "37+5="


def test_chat_template_with_and_without_system_prompt(tokenizer):
    ex = Example("What is 1+1?", "2")
    assert format_prompt(ex, tokenizer, DataConfig(chat_template=True)) == \
        "<|user|>What is 1+1?\n<|assistant|>"
    cfg = DataConfig(chat_template=True, system_prompt="Answer in \\boxed{}.")
    assert format_prompt(ex, tokenizer, cfg) == \
        "<|system|>Answer in \\boxed{}.\n<|user|>What is 1+1?\n<|assistant|>"


def test_tokenizer_without_template_is_a_config_error(tokenizer):
    bare = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, unk_token="<unk>")
    with pytest.raises(ConfigError, match=r"data\.chat_template: got True, but the tokenizer "
                                          r"\(\w+\) has no chat template"):
        format_prompt(Example("q", "1"), bare, DataConfig(chat_template=True))


def test_system_prompt_requires_a_format_with_roles():
    with pytest.raises(ConfigError, match=r"data\.system_prompt: got 'be brief', expected null "
                                          r"with raw prompts"):
        load_config(None, ["data.system_prompt=be brief"])
    for fmt in ("chat_template", "deepseek_v4"):
        load_config(None, ["model.path=/m", f"data.prompt_format={fmt}",
                           "data.system_prompt=be brief"])


def test_bos_comes_once_when_the_template_writes_it():
    """The presets' template starts with <bos>; prompt_ids adds none of its own then."""
    tok = build_char_tokenizer()
    ids = prompt_ids(Example("1+1=", "2"), tok, DataConfig(chat_template=True))
    assert ids[:2] == [tok.bos_token_id, tok.convert_tokens_to_ids("u")]
    raw = prompt_ids(Example("1+1=", "2"), tok, DataConfig())
    assert raw[:2] == [tok.bos_token_id, tok.convert_tokens_to_ids("1")]


def test_old_configs_keep_their_format():
    assert DataConfig().format == "raw"
    assert DataConfig(chat_template=True).format == "chat_template"
    assert load_config(REPO / "configs" / "qwen3_30b_a3b_2node.yaml", []).data.format == \
        "chat_template"
    assert load_config(REPO / "configs" / "deepseek_v4_flash_3node.yaml", []).data.format == \
        "deepseek_v4"


@pytest.mark.parametrize("overrides, needle", [
    (["data.chat_template=true", "data.prompt_format=deepseek_v4"],
     r"data\.chat_template: got True, expected false with prompt_format 'deepseek_v4' "
     r"\(chat_template: true is the older spelling of prompt_format: chat_template\)"),
    (["data.chat_template=true", "data.prompt_format=raw"],
     r"data\.chat_template: got True, expected false with prompt_format 'raw'"),
    (["data.deepseek_v4.thinking=false"],
     r"data\.deepseek_v4: got \{'thinking': False, 'reasoning_effort': 'high'\}, expected its "
     r"defaults with prompt_format 'raw'"),
    (["data.prompt_format=deepseek_v4", "data.deepseek_v4.thinking=false",
      "data.deepseek_v4.reasoning_effort=max"],
     r"data\.deepseek_v4\.reasoning_effort: got 'max', expected 'high' when thinking is false"),
])
def test_conflicting_format_settings_are_config_errors(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, ["model.path=/m", *overrides])


def test_deepseek_v4_is_refused_for_the_presets():
    """The presets' character tokenizer has no V4 markers (they would become <unk>): refused
    when the config loads, before any tokenizer exists."""
    with pytest.raises(ConfigError, match=r"<command line>:data\.prompt_format: got "
                                          r"'deepseek_v4', expected raw or chat_template with a "
                                          r"preset model \(tiny-deepseek-v4: its character "
                                          r"tokenizer has no <｜User｜>"):
        load_config(None, ["model.preset=tiny-deepseek-v4", "data.prompt_format=deepseek_v4"])

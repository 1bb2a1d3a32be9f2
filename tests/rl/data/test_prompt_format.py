"""format_prompt with a real (tiny, offline) Hugging Face tokenizer and its chat template."""
import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from rl.config import ConfigError, DataConfig, load_config
from rl.data import Example, format_prompt
from rl.data.datasets import prompt_ids
from rl.models.tokenizer import build_char_tokenizer

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


def test_system_prompt_requires_chat_template():
    with pytest.raises(ConfigError, match=r"data\.system_prompt: got 'be brief', expected null "
                                          r"unless chat_template is true"):
        load_config(None, ["data.system_prompt=be brief"])


def test_bos_comes_once_when_the_template_writes_it():
    """The presets' template starts with <bos>; prompt_ids adds none of its own then."""
    tok = build_char_tokenizer()
    ids = prompt_ids(Example("1+1=", "2"), tok, DataConfig(chat_template=True))
    assert ids[:2] == [tok.bos_token_id, tok.convert_tokens_to_ids("u")]
    assert prompt_ids(Example("1+1=", "2"), tok, DataConfig())[:2] == [tok.bos_token_id,
                                                                      tok.convert_tokens_to_ids("1")]

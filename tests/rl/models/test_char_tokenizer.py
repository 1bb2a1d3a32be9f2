import pytest

from rl.models.loading import load_tokenizer
from rl.models.tokenizer import CHARS, build_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_special_tokens_have_fixed_ids(tok):
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.convert_tokens_to_ids(["<pad>", "<bos>", "<eos>"]) == [0, 1, 2]


def test_every_printable_char_is_one_token(tok):
    assert len(tok) == 3 + len(CHARS) + 1  # + <unk>
    ids = tok(CHARS)["input_ids"]
    assert ids == list(range(3, 3 + len(CHARS)))


@pytest.mark.parametrize("text", ["12+34=46", "What is 7 * 8?\nAnswer: 56", "  a  b ", "#### -3"])
def test_round_trip(tok, text):
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text)  # no special tokens added, one id per character
    assert tok.decode(ids) == text


def test_special_token_text_is_one_token_and_skippable(tok):
    ids = tok("1<eos>")["input_ids"]
    assert ids == [tok.convert_tokens_to_ids("1"), 2]
    assert tok.decode(ids, skip_special_tokens=True) == "1"


def test_unknown_char_maps_to_unk(tok):
    ids = tok("1é")["input_ids"]
    assert ids[1] == tok.unk_token_id == len(tok) - 1


def test_chat_template(tok):
    chat = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
    assert tok.apply_chat_template(chat, tokenize=False) == "<bos>user: 1+1?\nassistant: 2<eos>\n"
    prompt = tok.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<bos>user: 1+1?\nassistant: "
    ids = tok.apply_chat_template(chat[:1], add_generation_prompt=True)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids[1:]) == prompt[len("<bos>"):]


def test_save_and_reload(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    again = load_tokenizer(tmp_path)
    text = "12+7=19\n"
    assert again(text)["input_ids"] == tok(text)["input_ids"]
    assert (again.pad_token_id, again.bos_token_id, again.eos_token_id) == (0, 1, 2)
    assert again.chat_template == tok.chat_template
    assert len(again) == len(tok)

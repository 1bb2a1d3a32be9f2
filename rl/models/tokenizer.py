"""A character-level tokenizer for the synthetic arithmetic tasks of the tiny presets.

Vocabulary (ids are fixed, so a saved preset and a rebuilt tokenizer always agree):
  0 `<pad>`, 1 `<bos>`, 2 `<eos>`, then one token per character of `CHARS` (printable ASCII
  32..126 followed by "\\n"), then `<unk>` last. `<unk>` stands for any other character, so a
  stray unicode symbol is visible in the ids instead of silently dropped.

Encoding adds no special tokens by itself (like Qwen tokenizers); the chat template starts with
`<bos>` and ends every assistant turn with `<eos>`, so SFT on templated text teaches the model to stop.
"""
from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
CHARS = "".join(chr(c) for c in range(32, 127)) + "\n"
MAX_LENGTH = 512

# "role: content" lines; assistant turns end in <eos>. `add_generation_prompt` opens an
# assistant turn, so the model's continuation is the answer and its <eos> ends generation.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"  # not a literal newline: the template engine trims those after a block tag
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character tokenizer (deterministic, offline). `len(tok)` is 100."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    vocab[UNK] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own pre-token ([\s\S] also matches "\n", unlike ".").
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()  # concatenate characters, no spaces between them
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    return tok

"""SFT and RL encode a prompt the same way: BOS first, cut to data.max_prompt_tokens."""
from rl.config import load_config
from rl.data.example import Example
from rl.data.source import PromptSource
from rl.models.tokenizer import build_char_tokenizer
from rl.sft import _encode


def test_sft_and_rl_encode_prompts_identically():
    tok = build_char_tokenizer()
    for keep in (256, 4):  # untouched, and cut to the last 4 tokens
        cfg = load_config(None, ["data.source=synthetic", f"data.max_prompt_tokens={keep}"])
        source = PromptSource(cfg, tok)
        sft = [p for p, _ in _encode(tok, cfg, source.train)]
        assert sft == source.train_ids
        assert all(len(p) <= keep for p in sft)
    ex = Example(prompt="12+7=", answer="19")
    (short, _), = _encode(tok, load_config(None, []), [ex])
    assert short[0] == tok.bos_token_id and len(short) == 1 + len("12+7=")

"""Dataset construction from `DataConfig` and prompt formatting for the policy."""
from __future__ import annotations

import logging
import random
import weakref
from typing import Any

from rl.config import ConfigError, DataConfig
from rl.data import deepseek_v4
from rl.data.example import DataError, Example
from rl.data.files import load_examples
from rl.data.synthetic import make_synthetic

log = logging.getLogger(__name__)


def build_datasets(cfg: DataConfig, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, eval) examples. Synthetic: generated from `seed`, disjoint. File: `train_path` and
    `eval_path`; without `eval_path`, `eval_fraction` of train_path's prompts held out
    (`split_eval`), or no eval set when the fraction is 0 (`eval_note` says which).

    Raises DataError for malformed files, ConfigError for impossible synthetic settings.
    """
    if cfg.source == "synthetic":
        return make_synthetic(cfg.synthetic, seed)
    assert cfg.train_path is not None  # DataConfig validates this for source: file
    keys: dict[str, Any] = dict(prompt_key=cfg.prompt_key, answer_key=cfg.answer_key,
                answer_format=cfg.answer_format)
    train = load_examples(cfg.train_path, **keys)
    if cfg.eval_path is not None:
        return train, load_examples(cfg.eval_path, **keys)
    if cfg.eval_fraction == 0:
        log.info(eval_note(cfg, seed))
        return train, []
    train, evals = split_eval(train, cfg.eval_fraction, seed, cfg.train_path)
    log.info("%s: %d train and %d eval examples", eval_note(cfg, seed), len(train), len(evals))
    return train, evals


def split_eval(examples: list[Example], fraction: float, seed: int,
               path: str = "data.train_path") -> tuple[list[Example], list[Example]]:
    """(train, eval): `fraction` of the distinct prompts (at least one) go to eval, chosen by a
    shuffle seeded from `seed`; both keep file order. Rows that repeat a prompt stay with it, so
    no eval prompt is trained on. DataError when fewer than two distinct prompts exist."""
    prompts = list(dict.fromkeys(ex.prompt for ex in examples))
    if len(prompts) < 2:
        raise DataError(f"{path}: holds {len(prompts)} distinct prompt(s), expected at least 2 to "
                        "hold some out for evaluation (set data.eval_path, or data.eval_fraction=0 "
                        "to run without evaluation)")
    num_eval = min(max(1, round(fraction * len(prompts))), len(prompts) - 1)
    # A string seed is hashed with SHA-512 by `random`, so the split is stable across processes.
    random.Random(f"eval-split:{seed}").shuffle(prompts)
    held_out = set(prompts[:num_eval])
    return ([ex for ex in examples if ex.prompt not in held_out],
            [ex for ex in examples if ex.prompt in held_out])


def eval_note(cfg: DataConfig, seed: int) -> str | None:
    """One line saying where the eval set of a file source comes from when `eval_path` is unset
    (None otherwise): a held-out share of train_path, or no evaluation at all."""
    if cfg.source != "file" or cfg.eval_path is not None:
        return None
    if cfg.eval_fraction == 0:
        return ("data.eval_path is not set and data.eval_fraction is 0: evaluation is off "
                "(no held-out accuracy)")
    return (f"data.eval_path is not set: holding out {cfg.eval_fraction:g} of the prompts of "
            f"{cfg.train_path} as the eval set (data.eval_fraction, split by seed {seed})")


def prompt_ids(example: Example, tokenizer: Any, cfg: DataConfig) -> list[int]:
    """The prompt's token ids as the policy sees them (formatted, BOS first exactly once when the
    tokenizer has one: a format whose text starts with BOS, as deepseek_v4 and many chat
    templates do, gets no second one), untruncated; the run keeps the last
    `cfg.max_prompt_tokens` of them."""
    ids = tokenizer(format_prompt(example, tokenizer, cfg), add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    return ids if bos is None or ids[:1] == [bos] else [bos] + ids


def encode_prompt(example: Example, tokenizer: Any, cfg: DataConfig) -> list[int]:
    """The prompt as the policy is trained on it, by RL and by the SFT warm start alike:
    `prompt_ids` cut to its last `cfg.max_prompt_tokens` tokens."""
    return prompt_ids(example, tokenizer, cfg)[-cfg.max_prompt_tokens:]


def format_prompt(example: Example, tokenizer: Any, cfg: DataConfig) -> str:
    """The text the policy sees, by `cfg.format` (docs/prompt_format.md): `example.prompt` as is
    (raw); one user turn with the optional system prompt and the generation prompt appended,
    through the tokenizer's chat template (chat_template) or DeepSeek-V4's published encoding
    (deepseek_v4, `rl.data.deepseek_v4`).

    `tokenizer` is a Hugging Face tokenizer. ConfigError when it cannot carry the format: no
    chat template, or a DeepSeek-V4 marker that is not one token.
    """
    fmt = cfg.format
    if fmt == "raw":
        return example.prompt
    if fmt == "deepseek_v4":
        _check_deepseek_v4_tokenizer(tokenizer)
        return deepseek_v4.encode_user_turn(example.prompt, cfg.system_prompt,
                                            cfg.deepseek_v4.thinking,
                                            cfg.deepseek_v4.reasoning_effort)
    if getattr(tokenizer, "chat_template", None) is None:
        key, value = (("chat_template", True) if cfg.prompt_format == "auto"
                      else ("prompt_format", "chat_template"))
        raise ConfigError(f"data.{key}: got {value!r}, but the tokenizer "
                          f"({type(tokenizer).__name__}) has no chat template; expected "
                          "data.prompt_format: raw for base models, or deepseek_v4 for "
                          "DeepSeek-V4 (its published prompt format is code, not a template)")
    messages = [{"role": "user", "content": example.prompt}]
    if cfg.system_prompt is not None:
        messages.insert(0, {"role": "system", "content": cfg.system_prompt})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# Tokenizers already checked to hold V4's markers as single tokens (checked once, not per prompt).
_V4_CHECKED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _check_deepseek_v4_tokenizer(tokenizer: Any) -> None:
    if tokenizer in _V4_CHECKED:
        return
    split = deepseek_v4.split_markers(tokenizer)
    if split:
        marker, n = split[0]
        raise ConfigError(f"data.prompt_format: got 'deepseek_v4', but the tokenizer "
                          f"({type(tokenizer).__name__}) splits {marker} into {n} tokens; "
                          f"expected a DeepSeek-V4 tokenizer, which holds each of "
                          f"{' '.join(deepseek_v4.SPECIAL_TOKENS)} as one token")
    _V4_CHECKED.add(tokenizer)

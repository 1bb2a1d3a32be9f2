"""Dataset construction from `DataConfig` and prompt formatting for the policy."""
from __future__ import annotations

import logging
from typing import Any

from rl.config import ConfigError, DataConfig
from rl.data.example import Example
from rl.data.files import load_examples
from rl.data.synthetic import make_synthetic

log = logging.getLogger(__name__)


def build_datasets(cfg: DataConfig, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, eval) examples. Synthetic: generated from `seed`, disjoint. File: `train_path` and
    `eval_path` (eval is empty, with a warning, when `eval_path` is unset).

    Raises DataError for malformed files, ConfigError for impossible synthetic settings.
    """
    if cfg.source == "synthetic":
        return make_synthetic(cfg.synthetic, seed)
    assert cfg.train_path is not None  # DataConfig validates this for source: file
    keys = dict(prompt_key=cfg.prompt_key, answer_key=cfg.answer_key,
                answer_format=cfg.answer_format)
    train = load_examples(cfg.train_path, **keys)
    if cfg.eval_path is None:
        log.warning("data.eval_path is not set: the eval set is empty")
        return train, []
    return train, load_examples(cfg.eval_path, **keys)


def format_prompt(example: Example, tokenizer: Any, cfg: DataConfig) -> str:
    """The text the policy sees: `example.prompt` as is, or (chat_template: true) wrapped in the
    tokenizer's chat template with the optional system prompt and the generation prompt appended.

    `tokenizer` is a Hugging Face tokenizer; it is only used when chat_template is true.
    """
    if not cfg.chat_template:
        return example.prompt
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(f"data.chat_template: got True, but the tokenizer "
                          f"({type(tokenizer).__name__}) has no chat template; expected false "
                          "for base models")
    messages = [{"role": "user", "content": example.prompt}]
    if cfg.system_prompt is not None:
        messages.insert(0, {"role": "system", "content": cfg.system_prompt})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

"""DeepSeek-V4's prompt format, for one user turn with the generation prompt appended.

DeepSeek publishes V4's chat format as Python (`encoding/encoding_dsv4.py` in the
deepseek-ai/DeepSeek-V4-Flash model repository), not as a Jinja template, so the published
tokenizer has no `chat_template`. This module writes the same string that file's
`encode_messages(messages, thinking_mode, reasoning_effort=...)` returns for
`[system?, user]` with its defaults (BOS added, `drop_thinking`), nothing more: no tools, no
multi-turn history, no assistant turns. The layout is

    <｜begin▁of▁sentence｜>[effort prefix][system]<｜User｜>{prompt}<｜Assistant｜><think>

with `</think>` instead of `<think>` in chat (non-thinking) mode. The system message is bare text
between BOS and `<｜User｜>`. The effort prefix appears only with `thinking` and
`reasoning_effort: max`; `high` renders exactly as DeepSeek's default (None).

vLLM 0.32 ships a later revision of that file (`vllm/tokenizers/deepseek_v4_encoding.py`) with
efforts low/high/max, where its `high` prefix is the text the published `max` adds. Every string
this module writes without `max` is the same under both revisions.
"""
from __future__ import annotations

from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END)
"""The markers the prompt or its response contain; each must be one token of the tokenizer."""

REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)


def encode_user_turn(prompt: str, system: str | None = None, thinking: bool = True,
                     reasoning_effort: str = "high") -> str:
    """The prompt text, BOS included, that opens the assistant's reply to `prompt`.

    thinking: the reply starts inside a `<think>` block (DeepSeek's "thinking" mode); false
    closes it at once (`</think>`, "chat" mode). reasoning_effort: `high` (DeepSeek's default)
    or `max` (a prefix asking for exhaustive reasoning; thinking mode only).
    """
    if reasoning_effort not in ("high", "max"):
        raise ValueError(f"reasoning_effort: got {reasoning_effort!r}, expected 'high' or 'max'")
    effort = REASONING_EFFORT_MAX if thinking and reasoning_effort == "max" else ""
    return (BOS + effort + (system or "") + USER + prompt + ASSISTANT
            + (THINK_START if thinking else THINK_END))


def split_markers(tokenizer: Any) -> list[tuple[str, int]]:
    """(marker, number of tokens) for each of `SPECIAL_TOKENS` the tokenizer does not encode as
    exactly one token: empty for a DeepSeek-V4 tokenizer."""
    out = []
    for marker in SPECIAL_TOKENS:
        n = len(tokenizer(marker, add_special_tokens=False)["input_ids"])
        if n != 1:
            out.append((marker, n))
    return out

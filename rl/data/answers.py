"""Answer extraction shared by data loading (reference answers) and rewards (responses).

Forms: GSM8K (`... #### 1,234` -> `1234`), MATH (`... \\boxed{\\frac{1}{2}}` -> `\\frac{1}{2}`,
nested braces allowed), raw (the whole text, stripped), and auto (the first of these that applies).
"""
from __future__ import annotations

import re
from typing import Literal

AnswerFormat = Literal["auto", "gsm8k", "boxed", "raw"]

_BOXED = re.compile(r"\\(?:boxed|fbox)\b")
_GSM8K_MARK = "####"


def find_boxed(text: str) -> tuple[str, int] | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) and the index just past it.

    Braces nest; `\\{` and `\\}` are literal and do not count. `\\boxed 5` (no braces) takes the
    next token. Returns None when there is no box or the last one is unbalanced (a truncated
    response), so a complete earlier box never stands in for a broken final one.
    """
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    i = matches[-1].end()
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        token = re.match(r"[^\s$]+", text[i:])
        return (token.group(0), i + token.end()) if token else None
    depth, start = 0, i + 1
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # an escaped character (`\{`, `\}`, `\\`) never opens or closes a group
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start:i], i + 1
        i += 1
    return None


def find_gsm8k(text: str) -> tuple[str, int] | None:
    """The answer after the last `####` (rest of that line, commas removed) and the index of that
    line's end. None when there is no marker or nothing follows it."""
    at = text.rfind(_GSM8K_MARK)
    if at < 0:
        return None
    end = text.find("\n", at)
    end = len(text) if end < 0 else end
    answer = text[at + len(_GSM8K_MARK):end].strip().replace(",", "")
    return (answer, end) if answer else None


def extract_answer(text: str, fmt: AnswerFormat) -> str | None:
    """The answer in `text` according to `fmt`, stripped; None when none is found.

    `auto` tries GSM8K if `####` is present, then `\\boxed`, then falls back to the raw text.
    """
    if fmt == "raw":
        found: tuple[str, int] | None = (text, len(text))
    elif fmt == "gsm8k":
        found = find_gsm8k(text)
    elif fmt == "boxed":
        found = find_boxed(text)
    elif fmt == "auto":
        if _GSM8K_MARK in text:
            found = find_gsm8k(text)
        elif _BOXED.search(text):
            found = find_boxed(text)
        else:
            found = (text, len(text))
    else:
        raise ValueError(f"unknown answer format {fmt!r}")
    if found is None:
        return None
    answer = found[0].strip()
    return answer or None


EXPECTED_FORM = {
    "gsm8k": "a GSM8K answer '... #### <answer>'",
    "boxed": "a MATH answer containing a balanced '\\boxed{<answer>}'",
    "raw": "a non-empty answer",
    "auto": "a non-empty answer ('#### <answer>', '\\boxed{<answer>}' or the answer itself)",
}
"""What each format expects, for error messages."""

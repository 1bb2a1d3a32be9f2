"""Built-in reward functions: math equivalence (math-verify), exact match, answer format.

Correctness functions share the user-plugin signature `fn(response, answer, meta) -> float`
(see `rl.rewards.plugin`); `response` is the decoded completion without EOS (its answer part
with `reward.answer_after`), `answer` the reference answer as extracted by `rl.data`.
"""
from __future__ import annotations

import re
from typing import Any, Literal

from rl.data.answers import extract_answer, find_boxed, find_gsm8k

ResponseFormat = Literal["auto", "number", "boxed", "gsm8k"]

_INTEGER = re.compile(r"[+-]?\d+")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
_CLEAN_TAIL = re.compile(r"[\s$.\\\])]*")
"""What may follow a final `\\boxed{..}`: whitespace and closing delimiters (`$`, `.`, `\\]`)."""


def math_equal(response: str, answer: str) -> bool:
    """Whether `response` states an answer mathematically equal to `answer` (`0.5`, `1/2` and
    `\\frac{1}{2}` agree). Integers on both sides take a fast path; everything else goes through
    math-verify, which finds the answer in free text (`\\boxed{..}`, `$..$`, a final number).

    No time limit of its own: some inputs (`\\boxed{9^{9^{9}}}`) make sympy run for minutes, and
    the reward workers bound every call (`reward.verify_timeout_s`, `rl.rewards.pool`).
    Raises ValueError when the reference answer itself cannot be parsed.
    """
    r, a = response.strip(), answer.strip()
    if _INTEGER.fullmatch(a) and _INTEGER.fullmatch(r):
        return int(a) == int(r)
    from math_verify import grader, parse, parser, verify  # slow import (sympy): math rewards only

    # math-verify's own timeouts (SIGALRM, main thread only) catch their alarm and return "not
    # equal", which would score a slow right answer as wrong; they stay off (None), and we
    # silence its warning that they are off.
    parser.TIMEOUT_WARNING_SHOWN = grader.TIMEOUT_WARNING_SHOWN = True
    # A bare reference (`\sqrt{2}`, `x^2+1`) is only recognised as LaTeX inside math delimiters.
    gold_text = a if ("$" in a or "\\boxed" in a) else f"${a}$"
    gold = parse(gold_text, parsing_timeout=None)
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {answer!r}")
    pred = parse(response, parsing_timeout=None)
    return bool(pred) and verify(gold, pred, timeout_seconds=None)


def math_reward(response: str, answer: str, meta: dict[str, Any] | None = None) -> float:
    """1.0 when `math_equal(response, answer)`, else 0.0."""
    return float(math_equal(response, answer))


def _normalise(text: str) -> str:
    return " ".join(text.split())


def exact_reward(response: str, answer: str, meta: dict[str, Any] | None = None) -> float:
    """1.0 when the response's answer equals `answer` up to whitespace (runs collapse, ends are
    stripped). The response's answer is its final `#### x` or `\\boxed{x}` if it has one, else the
    whole response."""
    found = extract_answer(response, "auto")
    return float(found is not None and _normalise(found) == _normalise(answer))


def format_reward(response: str, form: ResponseFormat = "auto") -> float:
    """1.0 when the response holds an extractable answer in the expected form and ends cleanly:
    `number`: the whole response is a number (`42`, `-3`, `0.5`, `1/2`);
    `boxed`: a balanced, non-empty final `\\boxed{..}` followed only by whitespace, `$`, `.`, `\\]`;
    `gsm8k`: a final `#### answer` line with nothing after it;
    `auto`: any of these.
    """
    text = response.strip()
    if form in ("number", "auto") and _NUMBER.fullmatch(text):
        return 1.0
    if form in ("boxed", "auto"):
        found = find_boxed(text)
        if found is not None and found[0].strip() and _CLEAN_TAIL.fullmatch(text[found[1]:]):
            return 1.0
    if form in ("gsm8k", "auto"):
        found = find_gsm8k(text)
        if found is not None and not text[found[1]:].strip():
            return 1.0
    return 0.0

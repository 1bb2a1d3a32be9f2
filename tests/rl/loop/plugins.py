"""Reward plugins for the loop tests, loaded as `tests.rl.loop.plugins:NAME`.

`short_answer` is deliberately easy to learn (a warm-started model answers with 1-3 characters;
rewarding <= 2 moves the policy within a few steps), so "the training reward rises" is a fast,
reliable check of the whole loop rather than of the tiny model's arithmetic.
"""


def short_answer(response: str, answer: str, meta: dict) -> float:
    return 1.0 if 0 < len(response.strip()) <= 2 else 0.0


def raises_sometimes(response: str, answer: str, meta: dict) -> float:
    if response.strip().startswith("1"):
        raise RuntimeError("plugin failure on purpose")
    return 0.0

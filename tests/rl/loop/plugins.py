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


def slow_reward_calls() -> int:
    """How many calls of `slow_short_answer` have started, in any reward worker (one line each in
    the file RL_TEST_REWARD_CALLS names)."""
    import os
    path = os.environ["RL_TEST_REWARD_CALLS"]
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for _ in f)


def slow_short_answer(response: str, answer: str, meta: dict) -> float:
    """`short_answer`, taking RL_TEST_REWARD_SLEEP_S seconds per sample (a slow verifier); each
    call appends a line to RL_TEST_REWARD_CALLS (the test reads where the run is)."""
    import os
    import time
    with open(os.environ["RL_TEST_REWARD_CALLS"], "a") as f:
        f.write(f"{time.monotonic()}\n")
    time.sleep(float(os.environ.get("RL_TEST_REWARD_SLEEP_S", "0")))
    return short_answer(response, answer, meta)

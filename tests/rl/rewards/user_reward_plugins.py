"""Reward plugins the tests load as `tests.rl.rewards.user_reward_plugins:NAME`."""


def length_match(response: str, answer: str, meta: dict) -> float:
    """A valid plugin: 1.0 when the response has as many characters as the answer."""
    return float(len(response.strip()) == len(answer)) * meta.get("scale", 1.0)


def raising(response: str, answer: str, meta: dict) -> float:
    if response == "boom":
        raise RuntimeError("plugin exploded")
    return 1.0


def not_finite(response: str, answer: str, meta: dict) -> float:
    return float("nan")


def not_a_number(response: str, answer: str, meta: dict) -> float:
    return "1.0"


NOT_CALLABLE = 3


def records_response(response: str, answer: str, meta: dict) -> float:
    """Appends what it was given to `meta["seen"]` (a list the test shares) and scores 1."""
    meta["seen"].append(response)
    return 1.0

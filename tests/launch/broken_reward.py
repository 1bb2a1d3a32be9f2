"""A reward plugin that cannot be imported (`tests.launch.broken_reward:score`): the console test
checks that the error still reaches the user when the libraries' output goes to a file."""
raise RuntimeError("reward plugin broken on purpose")


def score(response: str, answer: str, meta: dict) -> float:  # pragma: no cover - never imported
    return 0.0

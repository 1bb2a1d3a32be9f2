"""A reward plugin module whose import calls sys.exit (`tests.rl.rewards.exiting_reward_plugin:fn`):
it must be a config error at startup, never the end of the driver."""
import sys

sys.exit("this plugin's import exits")


def fn(response: str, answer: str, meta: dict) -> float:  # pragma: no cover - never reached
    return 1.0

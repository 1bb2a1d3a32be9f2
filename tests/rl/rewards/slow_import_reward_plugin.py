"""A reward plugin module whose import takes a minute (`tests.rl.rewards.slow_import_reward_plugin:fn`):
its workers never get ready within a short start timeout."""
import time

time.sleep(60)


def fn(response: str, answer: str, meta: dict) -> float:  # pragma: no cover - never reached
    return 1.0

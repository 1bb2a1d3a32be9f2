"""Environment worker processes: the reward workers' machinery (`rl.rewards.pool.RewardPool`:
fresh interpreters, a time limit per call, a hung or dead worker killed and replaced, the batch
going on over the others) running environment steps instead of reward calls."""
from __future__ import annotations

from rl.rewards.pool import RewardPool


class EnvPool(RewardPool):
    """`num_workers` processes stepping episodes of the environment class `path`; `map` takes
    calls `(row, state, message)` (`rl.envs.worker`) and returns one outcome per call:
    `(True, (state, (observation, reward, done)))` or `(False, "ErrorType: message")`.

    Episodes are not bound to a worker: each call carries the episode's pickled instance, so a
    call that fails loses only its own episode, and the results do not depend on the number of
    workers."""
    WORKER_MODULE = "rl.envs.worker"
    KIND = "environment"
    TIMEOUT_KEY = "env.step_timeout_s"

    def __init__(self, path: str, num_workers: int, timeout_s: float):
        """Raises ConfigError when the environment class cannot be imported."""
        super().__init__(path, num_workers, timeout_s)

import pytest

from rl.config import RewardConfig


@pytest.fixture(scope="session", autouse=True)
def warm_math_verify():
    """Import math-verify and build its LaTeX parser once (~2-3 s), so each test stays fast."""
    from rl.rewards import math_equal

    math_equal("$\\frac{1}{2}$", "0.5")
    math_equal("$x^2+1$", "1+x^2")  # first symbolic comparison pays for sympy caches


@pytest.fixture(scope="session")
def shared_pool():
    """`shared_pool(function)`: a RewardPool of 2 workers with the default time limit, started
    once per function for the whole session (a worker costs ~0.3 s to start, ~2 s more with
    math-verify's warm-up); pass it as `RewardComputer(cfg, pool=...)`."""
    from rl.rewards import RewardPool
    pools = {}

    def get(function: str) -> RewardPool:
        if function not in pools:
            pools[function] = RewardPool(function, 2, RewardConfig().verify_timeout_s)
        return pools[function]
    yield get
    for pool in pools.values():
        pool.close()

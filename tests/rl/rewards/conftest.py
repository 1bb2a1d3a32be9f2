import pytest


@pytest.fixture(scope="session", autouse=True)
def warm_math_verify():
    """Import math-verify and build its LaTeX parser once (~2-3 s), so each test stays fast."""
    from rl.rewards import math_equal

    math_equal("$\\frac{1}{2}$", "0.5")
    math_equal("$x^2+1$", "1+x^2")  # first symbolic comparison pays for sympy caches

"""RewardComputer: totals, format weight, plugins by dotted path, failures counted not fatal."""
import math
import threading
import time
from pathlib import Path

import pytest

from rl.config import ConfigError, RewardConfig, load_config
from rl.data import Example
from rl.rewards import RewardComputer, load_reward_function

PLUGINS = "tests.rl.rewards.user_reward_plugins"
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def importable_tests(monkeypatch):
    # Plugins are imported by dotted path from the repository root, however pytest was started.
    monkeypatch.syspath_prepend(str(REPO))


def bare(**kwargs) -> RewardConfig:
    """A RewardConfig built alone, without a Config to resolve `answer_after: auto`."""
    return RewardConfig(answer_after=None, **kwargs)


@pytest.fixture
def computer(shared_pool):
    """`computer(function=..., **reward_config)`: a RewardComputer on the session's workers."""
    def make(**kwargs) -> RewardComputer:
        kwargs.setdefault("function", "math")
        return RewardComputer(bare(**kwargs), pool=shared_pool(kwargs["function"]))
    return make


def examples(*answers, **meta):
    return [Example(prompt=f"p{i}", answer=a, meta=dict(meta)) for i, a in enumerate(answers)]


def test_math_total_is_correctness_plus_weighted_format(computer):
    computer = computer(function="math", format_weight=0.5)
    responses = ["42", "\\boxed{\\frac{1}{2}} because", "41", "$0.5$"]
    parts = computer.score(responses, examples("42", "0.5", "42", "1/2"))
    assert parts.correctness == [1.0, 1.0, 0.0, 1.0]
    assert parts.format == [1.0, 0.0, 1.0, 0.0]
    assert parts.total == [1.5, 1.0, 0.5, 1.0]
    assert computer(responses, examples("42", "0.5", "42", "1/2")) == parts.total
    assert computer.failures == 0


def test_exact_and_response_format(computer):
    computer = computer(function="exact", format_weight=1.0, response_format="boxed")
    assert computer(["\\boxed{x+1}", "x+1"], examples("x+1", "x+1")) == [2.0, 1.0]


def test_user_plugin_receives_meta(computer):
    computer = computer(function=f"{PLUGINS}:length_match")
    assert computer(["12", "123"], examples("42", "42", scale=2.0)) == [2.0, 0.0]


@pytest.mark.parametrize("name, error", [
    ("raising", "RuntimeError: plugin exploded"),
    ("not_finite", "ValueError: returned nan, expected a finite number"),
    ("not_a_number", "TypeError: returned '1.0' (str), expected a finite number"),
])
def test_failing_plugin_is_counted_not_fatal(computer, name, error):
    computer = computer(function=f"{PLUGINS}:{name}", format_weight=1.0)
    parts = computer.score(["boom", "7"], examples("7", "7"))
    assert parts.failed[0] and parts.total[0] == 0.0  # a failure also drops the format reward
    assert computer.failures == (2 if name != "raising" else 1)
    assert error in computer.errors[0]
    assert computer.errors[0].startswith(f"reward.function '{PLUGINS}:{name}' failed on sample 0")
    if name == "raising":
        assert parts.total[1] == 2.0 and not parts.failed[1]
    assert all(math.isfinite(x) for x in parts.total)


def test_error_messages_are_capped_but_failures_keep_counting(computer):
    computer = computer(function=f"{PLUGINS}:not_finite")
    for _ in range(3):
        computer(["1"] * 4, examples(*["1"] * 4))
    assert computer.failures == 12 and len(computer.errors) == 5


def test_unparseable_reference_in_math_is_a_counted_failure(computer):
    computer = computer(function="math")
    assert computer(["1.5", "1.5"], examples("$$", "3/2")) == [0.0, 1.0]
    assert computer.failures == 1 and "cannot parse the reference answer" in computer.errors[0]


# 9^(9^9) makes sympy stall for minutes: a real input that only the time limit ends.
PATHOLOGICAL = "\\boxed{9^{9^{9}}}"


def test_math_verify_timeout_is_a_counted_failure_in_any_thread():
    with RewardComputer(bare(function="math", verify_timeout_s=2.0, num_workers=2)) as computer:
        computer.pool.wait_ready()
        start = time.monotonic()
        parts = computer.score([PATHOLOGICAL, "$\\frac{3}{7}$"], examples("3/7", "3/7"))
        assert time.monotonic() - start < 10
        assert parts.failed == [True, False] and parts.total == [0.0, 1.0]
        assert computer.failures == 1
        assert "TimeoutError: no result within reward.verify_timeout_s=2s" in computer.errors[0]
        # The same off the main thread, where the SIGALRM limit it replaces could not reach.
        result = []
        thread = threading.Thread(target=lambda: result.append(
            computer.score([PATHOLOGICAL], examples("3/7")).failed))
        thread.start()
        thread.join(timeout=30)
        assert result == [[True]]



@pytest.mark.parametrize("path, message", [
    ("no_such_pkg_xyz.mod:fn", r"reward\.function: got 'no_such_pkg_xyz\.mod:fn', cannot import "
                               r"module 'no_such_pkg_xyz\.mod' \(ModuleNotFoundError: "),
    (f"{PLUGINS}:missing", rf"reward\.function: got '{PLUGINS}:missing', module '{PLUGINS}' has "
                           r"no attribute 'missing'; expected a function"),
    (f"{PLUGINS}:NOT_CALLABLE", r"module '.*' is not callable 'NOT_CALLABLE'"),
    (":fn", r"reward\.function: got ':fn', expected 'package\.module:function'"),
])
def test_bad_dotted_path_is_a_config_error(path, message):
    with pytest.raises(ConfigError, match=message):
        load_reward_function(path)
    with pytest.raises(ConfigError, match=message):
        RewardComputer(bare(function=path, num_workers=1))  # the error comes from the worker


def test_config_rejects_a_function_without_colon():
    with pytest.raises(ConfigError, match=r"reward\.function: got 'mymodule\.fn', expected "):
        load_config(None, ["reward.function=mymodule.fn"])


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="2 responses but 1 examples"):
        RewardComputer(bare(num_workers=0))(["1", "2"], examples("1"))

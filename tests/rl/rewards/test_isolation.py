"""Reward functions run in worker processes: a call that hangs, crashes its process, exits, or
returns garbage is one failed sample (reward 0, counted), never the end of the run or a stop
that waits; the rewards are the same whatever the number of workers; a plugin that cannot be
imported is a config error at startup."""
import sys
import threading
import time
from pathlib import Path

import pytest

from rl.config import ConfigError, RewardConfig
from rl.data import Example
from rl.rewards import RewardComputer, RewardPool
from rl.signals import StepAbandoned

PLUGINS = "tests.rl.rewards.user_reward_plugins"
SCRIPTED = f"{PLUGINS}:scripted"
REPO = Path(__file__).resolve().parents[3]
TIMEOUT_S = 2.0


@pytest.fixture(autouse=True)
def importable_tests(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))


@pytest.fixture(scope="module")
def scripted_pool():
    """Two workers running `scripted`, TIMEOUT_S per call, shared by this module's tests."""
    pool = RewardPool(SCRIPTED, 2, TIMEOUT_S)
    yield pool
    pool.close()


def config(**kwargs) -> RewardConfig:
    kwargs.setdefault("function", SCRIPTED)
    return RewardConfig(answer_after=None, format_weight=1.0, **kwargs)


def examples(n: int) -> list[Example]:
    return [Example(prompt=f"p{i}", answer="1", meta={}) for i in range(n)]


@pytest.mark.parametrize("response, error", [
    ("hang", f"TimeoutError: no result within reward.verify_timeout_s={TIMEOUT_S:g}s (worker "
             "killed and replaced)"),
    ("exit", "WorkerDied: the reward worker exited with status 3 during the call (replaced)"),
    ("segfault", "WorkerDied: the reward worker was killed by SIGSEGV during the call "
                 "(replaced)"),
    ("sys.exit", "SystemExit: 4"),
    ("nan", "ValueError: returned nan, expected a finite number"),
    ("raise", "RuntimeError: plugin exploded"),
    ("text", "TypeError: returned '1.0' (str), expected a finite number"),
])
def test_a_misbehaving_call_fails_its_sample_only(scripted_pool, response, error):
    computer = RewardComputer(config(), pool=scripted_pool)
    start = time.monotonic()
    parts = computer.score(["1", response, "1", "1"], examples(4))
    assert time.monotonic() - start < TIMEOUT_S + 5
    assert parts.failed == [False, True, False, False]
    assert parts.total == [2.0, 0.0, 2.0, 2.0]  # a failure also loses the format reward
    assert computer.failures == 1
    assert computer.errors == [f"reward.function {SCRIPTED!r} failed on sample 1 (answer '1'): "
                               f"{error}"[:300]]
    # The pool goes on (a dead or hung worker was replaced).
    assert computer.score(["1", "1"], examples(2)).total == [2.0, 2.0]


def test_calls_queued_behind_a_dead_or_hung_call_run_elsewhere(scripted_pool):
    # Two calls are queued per worker: "1" waits behind "hang", "1" behind "exit".
    computer = RewardComputer(config(), pool=scripted_pool)
    parts = computer.score(["hang", "1", "exit", "1", "1", "1"], examples(6))
    assert parts.failed == [True, False, True, False, False, False]
    assert parts.correctness == [0.0, 1.0, 0.0, 1.0, 1.0, 1.0]


def test_a_slow_call_within_the_limit_is_scored(scripted_pool):
    computer = RewardComputer(config(), pool=scripted_pool)
    parts = computer.score([f"sleep:{TIMEOUT_S / 4}", "1"], examples(2))
    assert parts.failed == [False, False] and parts.correctness == [1.0, 1.0]


def test_a_stop_request_during_a_hanging_call_returns_promptly():
    with RewardComputer(config(verify_timeout_s=600, num_workers=1)) as computer:
        asked = time.monotonic() + 0.5
        start = time.monotonic()
        with pytest.raises(StepAbandoned, match=r"stop requested while scoring \(0 of 2 done\)"):
            computer.score(["hang", "1"], examples(2), cancelled=lambda: time.monotonic() > asked)
        assert time.monotonic() - start < 2.0
        assert computer.failures == 0


def test_a_stop_request_works_from_a_signal_handler_while_waiting():
    """StopRequest sets its flag in a signal handler: the waiting pool still sees it."""
    import os
    import signal

    from rl.signals import StopRequest
    stop = StopRequest().install()
    try:
        with RewardComputer(config(verify_timeout_s=600, num_workers=1)) as computer:
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1)).start()
            start = time.monotonic()
            with pytest.raises(StepAbandoned):
                computer.score(["hang"], examples(1), cancelled=lambda: stop.requested)
            assert time.monotonic() - start < 2.0
    finally:
        stop.uninstall()


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_rewards_do_not_depend_on_the_number_of_workers(workers):
    responses = [f"{i * 37 % 101}" for i in range(60)]
    batch = [Example(prompt="p", answer=r if i % 4 == 0 else "x", meta={})
             for i, r in enumerate(responses)]
    cfg = config(function=f"{PLUGINS}:deterministic", num_workers=0)
    reference = RewardComputer(cfg)
    expected = reference.score(responses, batch)
    assert any(expected.failed) and not all(expected.failed)
    with RewardComputer(config(function=f"{PLUGINS}:deterministic",
                               num_workers=workers)) as computer:
        assert computer.score(responses, batch) == expected
        assert computer.errors == reference.errors and computer.failures == reference.failures


def test_a_plugin_that_cannot_be_imported_is_a_config_error_at_startup():
    path = "tests.rl.rewards.exiting_reward_plugin:fn"
    with pytest.raises(ConfigError, match=r"reward\.function: got 'tests\.rl\.rewards\."
                                          r"exiting_reward_plugin:fn', cannot import module .* "
                                          r"\(SystemExit: this plugin's import exits\)"):
        RewardComputer(config(function=path, num_workers=2))
    # Imported in the workers only: its import ran no code in this process.
    assert "tests.rl.rewards.exiting_reward_plugin" not in sys.modules


def test_workers_are_reused_and_closed():
    import os
    computer = RewardComputer(config(num_workers=2))
    pids = computer.pool.pids()
    for _ in range(3):
        computer.score(["1"] * 5, examples(5))
    assert computer.pool.pids() == pids and computer.pool.restarts == 0
    computer.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_shared_pool_must_run_the_configured_function(scripted_pool):
    with pytest.raises(ValueError, match="the pool runs .*scripted', the config names 'exact'"):
        RewardComputer(config(function="exact"), pool=scripted_pool)


def test_in_the_driver_exceptions_and_sys_exit_still_fail_one_sample():
    computer = RewardComputer(config(num_workers=0))
    parts = computer.score(["sys.exit", "raise", "1"], examples(3))
    assert parts.failed == [True, True, False] and computer.failures == 2


def test_num_workers_is_validated():
    from rl.config import load_config
    assert load_config(None, ["reward.num_workers=auto"]).reward.num_workers == "auto"
    assert load_config(None, ["reward.num_workers=3"]).reward.num_workers == 3
    with pytest.raises(ConfigError, match=r"reward\.num_workers: got -1, expected 'auto' or a "
                                          r"count >= 0"):
        load_config(None, ["reward.num_workers=-1"])


def test_workers_do_not_outlive_a_killed_driver(tmp_path):
    """A driver killed outright (SIGKILL: no finally, no atexit) with a call hanging: its
    workers exit by themselves."""
    import os
    import signal
    import subprocess
    driver = ("import sys\n"
              "from rl.rewards import RewardPool\n"
              f"pool = RewardPool({SCRIPTED!r}, 2, 600)\n"
              "print(*pool.pids(), flush=True)\n"
              "pool.map([('hang', '', {}), ('hang', '', {})])\n")
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=REPO, stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    pids = [int(p) for p in proc.stdout.readline().split()]
    time.sleep(0.5)  # the calls are running
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids)


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False

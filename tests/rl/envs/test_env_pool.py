"""Environment workers: isolation, time limits, failures counted, the batch going on."""
import pickle

import pytest

from rl.config import ConfigError
from rl.envs.pool import EnvPool

ROW = {"prompt": "47*38=", "answer": "1786"}


def message(text, calls=(), turn=1):
    return {"text": text, "turn": turn, "truncated": False,
            "tool_calls": [{"name": n, "arguments": a} for n, a in calls]}


@pytest.fixture(scope="module")
def pool():
    p = EnvPool("tests.rl.envs.envs:Misbehaving", 2, timeout_s=2.0)
    yield p
    p.close()


def test_steps_return_results_and_state(pool):
    out = pool.map([(ROW, None, message("[calc: 47*38]", [("calc", "47*38")])),
                    (ROW, None, message("1786")), (ROW, None, message("12"))])
    (ok, (state, result)), (ok2, (_, final)), (ok3, (_, wrong)) = out
    assert ok and ok2 and ok3
    assert result == (["1786"], None, False)
    assert final == (None, 1.0, True) and wrong == (None, 0.0, True)
    assert pickle.loads(state).steps == 1  # the instance, after its step


def test_state_travels_between_calls():
    with_pool = EnvPool("tests.rl.envs.envs:Counting", 1, timeout_s=5.0)
    try:
        state = None
        seen = []
        for turn in (1, 2, 3):
            ((ok, (state, result)),) = with_pool.map(
                [(ROW, state, message("[calc: 1]", [("calc", "1")], turn))])
            seen.append(result[0])
        assert seen == ["step 1", "step 2", "step 3"]
    finally:
        with_pool.close()


def test_hang_crash_garbage_raise_exit_fail_alone(pool):
    texts = ["hang", "1786", "crash", "garbage", "nanreward", "raise", "exit", "1786"]
    out = pool.map([(ROW, None, message(t)) for t in texts])
    ok = [o[0] for o in out]
    assert ok == [False, True, False, False, False, False, False, True]
    errors = dict(zip(texts, (o[1] for o in out)))
    assert "env.step_timeout_s=2" in errors["hang"]
    assert "environment worker" in errors["crash"]
    assert "expected rl.envs.StepResult" in errors["garbage"]
    assert "finite" in errors["nanreward"]
    assert "on purpose" in errors["raise"] and "SystemExit" in errors["exit"]
    assert pool.restarts >= 2  # the hung and the crashed workers were replaced
    # and the pool still works
    ((ok, (_, result)),) = pool.map([(ROW, None, message("1786"))])
    assert ok and result == (None, 1.0, True)


def test_unpicklable_state_is_a_failed_episode():
    p = EnvPool("tests.rl.envs.envs:NotPicklable", 1, timeout_s=5.0)
    try:
        ((ok, err),) = p.map([(ROW, None, message("1786"))])
        assert not ok and "pickle" in err.lower()
    finally:
        p.close()


def test_an_environment_that_cannot_be_imported_is_a_config_error():
    with pytest.raises(ConfigError, match=r"env.path: got 'tests.rl.envs.nope:X', cannot import"):
        EnvPool("tests.rl.envs.nope:X", 1, timeout_s=1.0)
    with pytest.raises(ConfigError, match="has no attribute 'Nope'"):
        EnvPool("tests.rl.envs.envs:Nope", 1, timeout_s=1.0)

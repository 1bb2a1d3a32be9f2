"""The synthetic arithmetic task: format, correctness, determinism, disjoint splits."""
import pytest

from rl.config import ConfigError, DataConfig, SyntheticConfig
from rl.data import build_datasets, make_synthetic
from rl.data.synthetic import evaluate, num_distinct_problems

SMALL = SyntheticConfig(num_train=300, num_eval=50, max_value=20)


def test_prompt_format_and_answers_are_correct():
    train, evals = make_synthetic(SMALL, seed=3)
    for ex in train + evals:
        a, op, b = ex.meta["operands"][0], ex.meta["operators"][0], ex.meta["operands"][1]
        assert ex.prompt == f"{a}{op}{b}="
        assert ex.answer == str(a + b if op == "+" else a - b)


def test_precedence_and_negative_operands():
    assert evaluate((2, 3, 4), ("+", "*")) == 14
    assert evaluate((2, 3, 4), ("*", "-")) == 2
    cfg = SyntheticConfig(num_train=50, num_eval=10, min_value=-5, max_value=5, num_operands=3,
                          operators=["+", "-", "*"])
    train, _ = make_synthetic(cfg, seed=0)
    for ex in train:
        assert ex.answer == str(eval(ex.prompt[:-1]))  # Python agrees on precedence and signs


def test_splits_are_deterministic_and_disjoint():
    train, evals = make_synthetic(SMALL, seed=7)
    again_train, again_eval = make_synthetic(SMALL, seed=7)
    assert (train, evals) == (again_train, again_eval)
    assert (len(train), len(evals)) == (300, 50)
    prompts = [e.prompt for e in train + evals]
    assert len(set(prompts)) == len(prompts)  # no eval prompt in train, no duplicates
    other_train, _ = make_synthetic(SMALL, seed=8)
    assert [e.prompt for e in other_train] != [e.prompt for e in train]


def test_eval_split_does_not_depend_on_num_train():
    _, evals = make_synthetic(SMALL, seed=1)
    _, evals_more = make_synthetic(SyntheticConfig(num_train=400, num_eval=50, max_value=20), 1)
    assert evals == evals_more


def test_large_space_uses_sampling_and_stays_disjoint():
    cfg = SyntheticConfig(num_train=500, num_eval=100, max_value=999, num_operands=2)
    assert num_distinct_problems(cfg) > 200_000
    train, evals = make_synthetic(cfg, seed=0)
    assert not {e.prompt for e in train} & {e.prompt for e in evals}
    assert make_synthetic(cfg, seed=0)[1] == evals


def test_too_small_space_is_a_config_error():
    cfg = SyntheticConfig(num_train=100, num_eval=10, max_value=4, operators=["+"])
    with pytest.raises(ConfigError, match=r"data\.synthetic\.num_train: got 100, expected "
                                          r"num_train \+ num_eval \(110\) <= 25"):
        make_synthetic(cfg, seed=0)


def test_build_datasets_synthetic_uses_seed():
    cfg = DataConfig(synthetic=SMALL)
    assert build_datasets(cfg, seed=5) == make_synthetic(SMALL, seed=5)

"""`data.eval_fraction`: a file source without `eval_path` holds out part of `train_path`."""
import json

import pytest

from rl.config import DataConfig
from rl.data import DataError, build_datasets
from rl.data.datasets import eval_note


def write_rows(path, prompts):
    path.write_text("".join(json.dumps({"question": p, "answer": f"#### {i}"}) + "\n"
                            for i, p in enumerate(prompts)))
    return str(path)


def cfg(path, **kw):
    return DataConfig(source="file", train_path=path, **kw)


def test_default_fraction_holds_out_a_disjoint_seeded_share(tmp_path):
    path = write_rows(tmp_path / "t.jsonl", [f"q{i}" for i in range(100)])
    train, evals = build_datasets(cfg(path), seed=0)
    assert (len(train), len(evals)) == (95, 5)  # the default eval_fraction is 0.05
    assert not {e.prompt for e in train} & {e.prompt for e in evals}
    assert sorted(e.prompt for e in train + evals) == sorted(f"q{i}" for i in range(100))
    # Deterministic from the seed; another seed holds out other prompts.
    again = build_datasets(cfg(path), seed=0)
    assert again == (train, evals)
    other = build_datasets(cfg(path), seed=1)[1]
    assert {e.prompt for e in other} != {e.prompt for e in evals}
    # Both splits keep file order (the sampler shuffles the train split itself).
    assert [e.meta["source"] for e in train] == sorted(
        (e.meta["source"] for e in train), key=lambda s: int(s.rsplit(":", 1)[1]))


def test_repeated_prompts_stay_on_one_side_and_tiny_files_keep_one_each(tmp_path):
    path = write_rows(tmp_path / "t.jsonl", ["a", "b", "a", "c", "a"])
    train, evals = build_datasets(cfg(path, eval_fraction=0.01), seed=3)
    assert len({e.prompt for e in evals}) == 1  # at least one prompt, even at 1%
    assert not {e.prompt for e in train} & {e.prompt for e in evals}
    assert len(train) + len(evals) == 5
    train, evals = build_datasets(cfg(write_rows(tmp_path / "two.jsonl", ["a", "b"]),
                                      eval_fraction=0.9), seed=0)
    assert (len(train), len(evals)) == (1, 1)  # train always keeps one


def test_a_single_prompt_cannot_be_split(tmp_path):
    path = write_rows(tmp_path / "one.jsonl", ["a", "a"])
    with pytest.raises(DataError, match=r"one.jsonl: holds 1 distinct prompt\(s\), expected at "
                                        r"least 2 .*data.eval_fraction=0"):
        build_datasets(cfg(path), seed=0)


def test_eval_path_wins_and_fraction_zero_turns_evaluation_off(tmp_path):
    path = write_rows(tmp_path / "t.jsonl", [f"q{i}" for i in range(10)])
    evals = write_rows(tmp_path / "e.jsonl", ["x"])
    train, ev = build_datasets(cfg(path, eval_path=evals), seed=0)
    assert (len(train), [e.prompt for e in ev]) == (10, ["x"])
    assert eval_note(cfg(path, eval_path=evals), 0) is None
    train, ev = build_datasets(cfg(path, eval_fraction=0), seed=0)
    assert (len(train), ev) == (10, [])
    assert "evaluation is off" in eval_note(cfg(path, eval_fraction=0), 0)
    assert "holding out 0.05 of the prompts of" in eval_note(cfg(path), 0)
    assert eval_note(DataConfig(), 0) is None  # synthetic: num_eval decides

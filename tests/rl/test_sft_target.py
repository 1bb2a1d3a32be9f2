"""`sft.target_accuracy`: the warm start stops at the first check that reaches it, records the
steps it took and its checks, and a target never reached runs every step."""
import json
from pathlib import Path

import pytest
import torch

from rl.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]


def _cfg(tmp_path, *overrides):
    return load_config(REPO / "configs" / "local.yaml", [
        f"sft.cache_dir={tmp_path}/sft", "sft.steps=40", "sft.batch_size=16",
        "sft.check_every=10", "sft.check_examples=32", "eval.num_prompts=16",
        "data.synthetic.num_train=200", "data.synthetic.num_eval=16", *overrides])


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def test_a_reached_target_stops_the_warm_start_early(tmp_path, monkeypatch):
    from rl import sft
    accuracy = iter([0.0, 0.1, 0.5, 0.9])  # the checks' greedy accuracy, in order
    real = sft.greedy_accuracy
    seen = []

    def fake(model, tok, cfg, examples, max_new_tokens, **kwargs):
        if len(examples) == 32 and len(seen) < 4:  # a check (the final eval has 16 problems)
            seen.append(examples)
            return next(accuracy)
        return real(model, tok, cfg, examples, max_new_tokens, **kwargs)
    monkeypatch.setattr(sft, "greedy_accuracy", fake)
    out, _ = sft.run_sft(_cfg(tmp_path, "sft.target_accuracy=0.4"))
    record = json.loads((out / "sft.json").read_text())
    assert record["steps"] == 30 and record["checks"] == [[10, 0.0], [20, 0.1], [30, 0.5]]
    train, evals = sft.build_datasets(_cfg(tmp_path).data, 0)
    assert [e.prompt for e in seen[0]] == [e.prompt for e in train[:32]]  # training problems


def test_without_a_target_every_step_runs_and_nothing_is_checked(tmp_path):
    from rl import sft
    out, _ = sft.run_sft(_cfg(tmp_path))
    record = json.loads((out / "sft.json").read_text())
    assert record["steps"] == 40 and record["checks"] == []


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2"])
def test_a_target_outside_0_1_is_a_config_error(tmp_path, value):
    with pytest.raises(ConfigError, match=r"sft\.target_accuracy"):
        _cfg(tmp_path, f"sft.target_accuracy={value}")

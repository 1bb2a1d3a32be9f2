"""The demo's headline number: mean of the last evaluations against the warm start."""
import json

import pytest

from job.run import summary, summary_record
from rl.config import load_config
from rl.evaluate import mean_of_last_evals, read_metrics_jsonl
from rl.loop import RunResult


def test_mean_of_last_three_evals_skips_steps_without_eval():
    rows = [{"step": s, "reward/mean": 0.1} for s in range(1, 11)]
    rows += [{"step": 2, "eval/pass1": 0.1}, {"step": 10, "eval/pass1": 0.7},
             {"step": 4, "eval/pass1": 0.3}, {"step": 8, "eval/pass1": 0.6},
             {"step": 6, "eval/pass1": 0.2}]
    mean, steps = mean_of_last_evals(rows)
    assert steps == [6, 8, 10]
    assert mean == pytest.approx(0.5)


def test_mean_of_last_evals_with_fewer_or_none():
    assert mean_of_last_evals([{"step": 3, "eval/pass1": 0.4}]) == (0.4, [3])
    assert mean_of_last_evals([{"step": 1, "train/loss": 1.0}]) == (None, [])


def test_read_metrics_jsonl(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_metrics_jsonl(path) == []
    path.write_text(json.dumps({"step": 1, "eval/pass1": 0.5}) + "\n\n")
    assert read_metrics_jsonl(path) == [{"step": 1, "eval/pass1": 0.5}]


def test_summary_reports_gain_of_the_mean_over_warm_start():
    cfg = load_config("configs/local.yaml", ["eval.num_prompts=500"])
    result = RunResult(status="done", step=250, run_dir="/tmp/x", warm_start_accuracy=0.3,
                       final_accuracy=0.52, final_mean_accuracy=0.5,
                       final_mean_steps=[200, 225, 250], eval_problems=500)
    rec = summary_record(cfg, result)
    assert rec["gain"] == pytest.approx(0.2)
    assert rec["final_mean_steps"] == [200, 225, 250] and rec["eval_problems"] == 500
    json.dumps(rec)  # machine-readable as is
    text = summary(cfg, result)
    assert "warm start 0.300 -> mean of the last 3 evals 0.500 (+20.0 points)" in text
    assert "steps 200, 225, 250; last eval 0.520" in text
    empty = RunResult(status="stopped", step=0, run_dir="/tmp/x")
    assert summary_record(cfg, empty)["gain"] is None
    assert "warm start n/a; no evaluation since" in summary(cfg, empty)
    # stopped at step 3 of a run evaluating every 4: the warm start and nothing averaged
    early = RunResult(status="stopped", step=3, run_dir="/tmp/x", warm_start_accuracy=0.062,
                      final_accuracy=0.062, eval_problems=16)
    text = summary(cfg, early)
    assert "(16 problems): warm start 0.062; no evaluation since" in text
    assert "mean of the last" not in text and "evals averaged" not in text


def test_summary_counts_the_problems_really_evaluated():
    # a user's small file: 5% of 80 prompts held out = 4, fewer than eval.num_prompts
    cfg = load_config("configs/local.yaml", ["eval.num_prompts=16"])
    result = RunResult(status="done", step=4, run_dir="/tmp/x", warm_start_accuracy=0.0,
                       final_mean_accuracy=0.25, final_mean_steps=[2, 4], eval_problems=4)
    assert summary_record(cfg, result)["eval_problems"] == 4
    assert "held-out greedy accuracy (4 problems)" in summary(cfg, result)

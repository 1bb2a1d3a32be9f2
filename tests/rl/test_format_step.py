"""The console line of one step (`rl.recorder.format_step`): what differs, nothing twice."""
from pathlib import Path

from rl.config import load_config
from rl.recorder import format_step

ROOT = Path(__file__).resolve().parents[2]
METRICS = {"reward/mean": 0.4375, "rollout/accuracy": 0.4375, "reward/format": 0.8125,
           "rollout/response_length": 3.25, "rollout/truncated_frac": 0.0625,
           "rollout/tokens_per_s": 1234.4, "train/loss": -0.0123, "train/approx_kl": 0.0012,
           "train/grad_norm": 0.321, "sync/seconds": 0.09, "time/step": 2.04}


def _line(*overrides: str, metrics=METRICS) -> list[str]:
    cfg = load_config(ROOT / "configs" / "local.yaml", list(overrides))
    return format_step(cfg, 12, metrics).split(" | ")


def test_pure_correctness_shows_reward_once_plus_truncation_and_throughput():
    fields = _line()
    assert fields[:2] == ["step   12/250", "reward 0.438"]
    assert not any(f.startswith(("acc ", "format ")) for f in fields)
    assert "trunc 0.06" in fields and "1234 tok/s" in fields and "len 3.2" in fields
    assert fields[-1] == "2.0s"


def test_format_weight_adds_accuracy_and_format_reward():
    fields = _line("reward.format_weight=0.5",
                   metrics={**METRICS, "reward/mean": 0.84375})  # 0.4375 + 0.5 * 0.8125
    assert fields[1:4] == ["reward 0.844", "acc 0.438", "format 0.812"]


def test_plugin_reward_shows_accuracy_but_no_format_reward():
    fields = _line("reward.function=tests.rl.loop.plugins:short_answer")
    assert "acc 0.438" in fields and not any(f.startswith("format ") for f in fields)


def test_eval_and_staleness_fields_stay():
    fields = _line("algorithm.max_staleness=1", metrics={**METRICS, "eval/pass1": 0.47,
                                                         "rollout/staleness_mean": 0.5})
    assert "EVAL pass@1 0.470" in fields
    assert any(f.startswith("stale 0.50 idle trainer") for f in fields)

"""reward.answer_after: only the answer after the reasoning is scored (DeepSeek-V4's `</think>`),
a response whose reasoning never closed scores 0 and is counted, and `auto` follows the prompt
format."""
import json
from pathlib import Path

import pytest

from rl.config import ConfigError, RewardConfig, load_config
from rl.data import Example
from rl.data.deepseek_v4 import THINK_END
from rl.recorder import rollout_metrics
from rl.rewards import RewardComputer
from rl.rollout.base import Sample

PLUGINS = "tests.rl.rewards.user_reward_plugins"
REPO = Path(__file__).resolve().parents[3]
V4 = ["model.path=/m", "data.prompt_format=deepseek_v4"]


@pytest.fixture(autouse=True)
def importable_tests(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))


@pytest.fixture
def thinking(shared_pool):
    """`thinking(function=..., **reward_config)`: a computer scoring after `</think>`, on the
    session's workers for that function."""
    return lambda **kwargs: RewardComputer(RewardConfig(answer_after=THINK_END, **kwargs),
                                           pool=shared_pool(kwargs["function"]))


def seen_responses(path: Path) -> list[str]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def examples(*answers, **meta):
    return [Example(prompt=f"p{i}", answer=a, meta=dict(meta)) for i, a in enumerate(answers)]


def test_math_scores_only_the_text_after_the_last_marker(thinking):
    responses = [
        # Scored whole, math-verify takes the boxed 42 of the reasoning and calls this right.
        "Maybe \\boxed{42}? Check again.</think>The answer is 41.",
        "First guess: 41. No, 40 + 2.</think>\n\\boxed{42}",
    ]
    parts = thinking(function="math").score(responses, examples("42", "42"))
    assert parts.correctness == [0.0, 1.0]
    assert parts.unclosed == [False, False]
    # A reasoning that quotes the marker: the answer follows the last one.
    assert thinking(function="exact")(["41</think>41</think>42"], examples("42")) == [1.0]


def test_unclosed_reasoning_scores_zero_and_is_counted_not_failed(thinking):
    computer = thinking(function="math", format_weight=1.0)
    parts = computer.score(["So the answer is \\boxed{42}", "x</think>\\boxed{42}"],
                           examples("42", "42"))
    assert parts.total == [0.0, 2.0] and parts.correctness == [0.0, 1.0]
    assert parts.format == [0.0, 1.0]
    assert parts.unclosed == [True, False] and parts.failed == [False, False]
    assert computer.failures == 0 and computer.errors == []
    samples = [Sample(prompt_ids=[1], response_ids=[2, 3], text=r, logprobs=[0.0, 0.0],
                      finish_reason="length", weight_version=0)
               for r in ("So the answer is \\boxed{42}", "x</think>\\boxed{42}")]
    metrics = rollout_metrics(samples, parts, seconds=1.0, n_samples=2, failures=0)
    assert metrics["reward/unclosed_thinking_frac"] == 0.5


def test_format_reward_judges_the_stripped_answer(thinking):
    computer = thinking(function="exact", format_weight=1.0, response_format="number")
    parts = computer.score(["3 + 4 is 7, check: 7 - 4 = 3 </think>  7\n", "7</think> so 7"],
                           examples("7", "7"))
    assert parts.format == [1.0, 0.0]
    assert parts.correctness == [1.0, 0.0]


def test_a_plugin_receives_the_answer_only_and_is_not_called_without_it(thinking, tmp_path):
    seen = tmp_path / "seen.jsonl"
    computer = thinking(function=f"{PLUGINS}:records_response")
    parts = computer.score(["12 or 13?</think>\n 42 \n", "still thinking about 42"],
                           examples("42", "42", seen=str(seen)))
    assert seen_responses(seen) == ["42"]
    assert parts.correctness == [1.0, 0.0]


def test_null_scores_the_whole_response(shared_pool, tmp_path):
    seen = tmp_path / "seen.jsonl"
    function = f"{PLUGINS}:records_response"
    computer = RewardComputer(RewardConfig(answer_after=None, function=function),
                              pool=shared_pool(function))
    parts = computer.score(["12</think> 42", "42"], examples("42", "42", seen=str(seen)))
    assert sorted(seen_responses(seen)) == ["12</think> 42", "42"]
    assert parts.unclosed == [False, False]


@pytest.mark.parametrize("overrides, expected", [
    ([], None),                                                   # raw (the default)
    (["data.prompt_format=raw"], None),
    (["data.prompt_format=chat_template"], None),
    (["data.chat_template=true"], None),
    (V4, THINK_END),                                              # thinking is DeepSeek's default
    (V4 + ["data.deepseek_v4.thinking=true"], THINK_END),
    (V4 + ["data.deepseek_v4.thinking=false"], None),             # the prompt closes the block
    (V4 + ["reward.answer_after=null"], None),                    # explicit settings stay
    (["reward.answer_after='Final answer:'"], "Final answer:"),
])
def test_auto_resolves_from_the_prompt_format(overrides, expected):
    assert load_config(None, overrides).reward.answer_after == expected


def test_the_3node_v4_config_scores_after_the_reasoning():
    cfg = load_config(REPO / "configs" / "deepseek_v4_flash_3node.yaml")
    assert cfg.reward.answer_after == THINK_END


@pytest.mark.parametrize("value", ["none", "None", "' '"])
def test_blank_or_none_marker_is_a_config_error(value):
    with pytest.raises(ConfigError, match=r"reward\.answer_after: got "):
        load_config(None, [f"reward.answer_after={value}"])


def test_an_unresolved_auto_is_refused():
    with pytest.raises(ValueError, match="answer_after: got 'auto'"):
        RewardComputer(RewardConfig())

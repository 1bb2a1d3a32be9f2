"""The submit-time data check encodes prompts with the run's tokenizer in the run's prompt format:
DeepSeek-V4's format passes on a tokenizer in the published layout; a chat template asked of
that tokenizer (which has none) is one line, exit 2, naming the key and suggesting deepseek_v4."""
import json
from pathlib import Path

import pytest

from launch.checks import check_data_or_exit
from rl.config import load_config
from tests.helpers.v4_published import write_published_tokenizer

REPO = Path(__file__).resolve().parents[2]
DSV4 = REPO / "configs" / "deepseek_v4_flash_3node.yaml"


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """The 3-node config's overrides: the tiny published-layout V4 directory as model.path, and
    a two-row file split (the config's /shared paths are not on this machine)."""
    root = tmp_path_factory.mktemp("v4")
    write_published_tokenizer(root / "DeepSeek-V4-Flash-BF16")
    rows = root / "rows.jsonl"
    rows.write_text("".join(json.dumps({"question": f"What is {i}+1?", "answer": f"#### {i + 1}"})
                            + "\n" for i in range(2)))
    return [f"model.path={root / 'DeepSeek-V4-Flash-BF16'}", f"data.train_path={rows}",
            f"data.eval_path={rows}"]


def test_the_3node_config_passes_on_the_published_layout(published, capsys):
    cfg = load_config(DSV4, published)
    assert cfg.data.format == "deepseek_v4"
    check_data_or_exit(cfg)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("override, key", [
    ("data.prompt_format=chat_template", "data.prompt_format: got 'chat_template'"),
    ("data.chat_template=true", "data.chat_template: got True")])
def test_a_chat_template_on_the_published_tokenizer_is_refused(published, capsys, override, key):
    overrides = [*published, override]
    if override.startswith("data.chat_template"):  # the older spelling, as configs had it
        overrides.append("data.prompt_format=auto")
    with pytest.raises(SystemExit) as e:
        check_data_or_exit(load_config(DSV4, overrides))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"config error: {key}, but the tokenizer (TokenizersBackend) has no "
                          "chat template; expected data.prompt_format: raw for base models, or "
                          "deepseek_v4 for DeepSeek-V4")


def test_a_synthetic_source_checks_the_format_too(published, capsys):
    """No rows to measure, but model.path's tokenizer is here: the first prompt is encoded."""
    with pytest.raises(SystemExit) as e:
        check_data_or_exit(load_config(DSV4, [*published, "data.source=synthetic",
                                              "data.prompt_format=chat_template"]))
    assert e.value.code == 2 and "has no chat template" in capsys.readouterr().err


def test_an_answer_marker_that_decoding_drops_is_refused(published, capsys):
    """EOS is a special token: no response text holds it, so every response would score 0."""
    check_data_or_exit(load_config(DSV4, [*published, "reward.answer_after='Final answer:'"]))
    with pytest.raises(SystemExit) as e:
        check_data_or_exit(load_config(DSV4, [*published,
                                              "reward.answer_after=<｜end▁of▁sentence｜>"]))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("config error: reward.answer_after: got '<｜end▁of▁sentence｜>', but "
                          "the run's tokenizer drops it when decoding responses")

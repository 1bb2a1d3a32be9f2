import json
from pathlib import Path

import pytest

from rl.plan.arch import parse

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "model_configs"


def _published(name: str):
    return parse(json.loads((FIXTURES / f"{name}.json").read_text()), name)


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """tests/fixtures/model_configs: published config.json files."""
    return FIXTURES


@pytest.fixture(scope="session")
def published():
    """`published(name)`: the Arch of tests/fixtures/model_configs/<name>.json."""
    return _published


@pytest.fixture(scope="session")
def v4_flash():
    return _published("DeepSeek-V4-Flash")


@pytest.fixture(scope="session")
def qwen3_8b():
    return _published("Qwen3-8B")

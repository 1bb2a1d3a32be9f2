"""Presets built once per test session (each build is ~0.1-0.3 s once torch is imported)."""
from pathlib import Path

import pytest
import torch

from rl.models.presets import PRESETS, build_preset


@pytest.fixture(scope="session")
def preset_dirs(tmp_path_factory) -> dict[str, Path]:
    """{preset name: directory built with seed 0}."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("presets")
    return {name: build_preset(name, root / name, seed=0) for name in PRESETS}

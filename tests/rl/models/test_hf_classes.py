"""HF models load with transformers' own classes even after vLLM registered its config classes."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

# In a fresh process: build the tiny V4 preset, let vLLM register its DeepseekV4Config with
# AutoConfig exactly as it does when it loads a V4 model, then load and build V4 the HF way.
SCRIPT = """
import sys, torch
from rl.models.loading import load_model
from rl.models.presets import build_model, build_preset
d = build_preset("tiny-deepseek-v4", sys.argv[1], seed=0)
from vllm.transformers_utils.config import _CONFIG_REGISTRY, _maybe_register_hf_config
from transformers import AutoConfig
_maybe_register_hf_config(load_model(d, torch.float32).config)
assert AutoConfig.for_model("deepseek_v4").__class__ is _CONFIG_REGISTRY["deepseek_v4"], "no clash"
print(type(load_model(d, torch.float32)).__name__, type(build_model("tiny-deepseek-v4")).__name__)
"""


@pytest.mark.slow
def test_hf_v4_loads_after_vllm_registered_its_v4_config(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "v4")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-2:] == ["DeepseekV4ForCausalLM", "DeepseekV4ForCausalLM"]

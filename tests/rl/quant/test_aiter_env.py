"""rollout.use_aiter -> the environment of the vLLM engine process.

ROCm itself is UNTESTED (no AMD GPU in CI or on the GPU machine): these tests check the variables
that would be set, with `torch.version.hip` replaced by a mock version string, and that their
names exist in the installed vLLM (vllm/envs.py), so a rename there fails here.
"""
import os

import pytest
import torch

from rl.config import load_config
from rl.quant.backends import vllm_aiter_env, vllm_engine_env

SWITCHES = ("VLLM_ROCM_USE_AITER", "VLLM_ROCM_USE_AITER_LINEAR", "VLLM_ROCM_USE_AITER_MOE",
            "VLLM_ROCM_USE_AITER_RMSNORM", "VLLM_ROCM_USE_AITER_MHA", "VLLM_ROCM_USE_AITER_MLA")


def test_rocm_sets_every_switch_either_way_and_other_platforms_none():
    assert vllm_engine_env(True, is_rocm=True) == dict.fromkeys(SWITCHES, "1")
    assert vllm_engine_env(False, is_rocm=True) == dict.fromkeys(SWITCHES, "0")
    assert vllm_engine_env(True, is_rocm=False) == {}


def test_switch_names_are_vllms():
    import vllm.envs

    assert set(vllm_aiter_env(True)) <= set(vllm.envs.environment_variables)


@pytest.mark.parametrize("use_aiter, value", [(True, "1"), (False, "0")])
def test_the_engine_exports_them_on_rocm(monkeypatch, use_aiter, value):
    from rl.rollout import vllm_engine

    monkeypatch.setattr(torch.version, "hip", "6.2.0-mock")  # mock: pretend a ROCm torch
    for name in SWITCHES:
        monkeypatch.setenv(name, "1" if value == "0" else "0")  # an inherited opposite value
    # _configure_environment also sets this one; monkeypatch restores it after the test
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    cfg = load_config(None, [f"rollout.use_aiter={str(use_aiter).lower()}"]).rollout
    vllm_engine._configure_environment(cfg)
    assert {name: os.environ[name] for name in SWITCHES} == dict.fromkeys(SWITCHES, value)

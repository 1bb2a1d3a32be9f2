"""`rl.rollout.vllm_cpu`: the decisions that follow vLLM-CPU's own capability test, with the
capability faked (torch's answer, which is what vLLM reads) and checked against vLLM's code."""
import pytest
import torch

from rl.rollout import vllm_cpu


@pytest.fixture
def cpu(monkeypatch):
    """`cpu(machine, amx)`: pretend to be that CPU, as vLLM and `vllm_cpu` see it."""
    def pretend(machine: str, amx: bool) -> None:
        monkeypatch.setattr(vllm_cpu.platform, "machine", lambda: machine)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    return pretend


@pytest.mark.parametrize("machine, amx, dtype, backend", [
    ("x86_64", True, torch.bfloat16, "AMX_MLA"),    # Xeon with AMX, production dtype
    ("x86_64", True, torch.float32, "CPU_MLA"),     # ... fp32: named, AMX_MLA would refuse it
    ("x86_64", True, torch.float16, "CPU_MLA"),
    ("x86_64", False, torch.bfloat16, "CPU_MLA"),   # AVX2 / AVX-512 without AMX
    ("x86_64", False, torch.float32, "CPU_MLA"),
    ("aarch64", True, torch.bfloat16, "CPU_MLA"),   # vLLM's AMX branch is x86-only
])
def test_mla_backend_follows_vllms_amx_test(cpu, machine, amx, dtype, backend):
    cpu(machine, amx)
    assert vllm_cpu.has_amx_tiles() == (amx and machine == "x86_64")
    assert vllm_cpu.mla_backend(dtype) == backend
    named = vllm_cpu.mla_overrides(dtype).get("attention_backend")
    assert named == (None if dtype == torch.bfloat16 else "CPU_MLA")


def test_the_faked_capability_is_the_one_vllm_reads(cpu):
    """vLLM picks AMX_MLA from the very call faked above, and CPU_MLA when it is named: what
    `mla_backend` predicts for each case, asked of vLLM's platform itself."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import CpuArchEnum
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    class Selector:  # the two fields the CPU platform reads for MLA
        use_sparse, use_mla = False, True

    for amx in (True, False):
        cpu("x86_64", amx)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(CpuPlatform, "get_cpu_architecture", classmethod(lambda c: CpuArchEnum.X86))
            for dtype in (torch.bfloat16, torch.float32):
                named = vllm_cpu.mla_overrides(dtype).get("attention_backend")
                selected = AttentionBackendEnum[named] if named else None
                path = CpuPlatform.get_attn_backend_cls(selected, Selector())
                assert path == AttentionBackendEnum[vllm_cpu.mla_backend(dtype)].get_path(), (
                    amx, dtype)


def test_engine_kwargs_name_cpu_mla_for_fp32_mla_models_only(tmp_path):
    from rl.config import RolloutConfig
    from rl.models.presets import build_preset
    from rl.rollout.vllm_engine import engine_kwargs

    cfg = RolloutConfig(engine="vllm")
    for name, fp32, bf16 in (("tiny-deepseek-v3", "CPU_MLA", None), ("tiny-qwen3-moe", None, None),
                             ("tiny-deepseek-v4", None, None)):
        model_dir = build_preset(name, tmp_path / name, seed=0)
        for dtype, want in ((torch.float32, fp32), (torch.bfloat16, bf16)):
            kwargs = engine_kwargs(model_dir, cfg, torch.device("cpu"), dtype)
            assert kwargs.get("attention_backend") == want, (name, dtype)
        gpu = engine_kwargs(model_dir, cfg, torch.device("cuda"), torch.float32)
        assert "attention_backend" not in gpu  # a GPU keeps vLLM's own choice

"""The trainer's memory settings live under `trainer.`: old `plan.` keys are reported where they
moved, and a resume refuses a change of any of them (they change what the trainer computes)."""
import pytest

from rl.config import ConfigError, load_config, to_dict
from rl.resume import config_differences

MOVED = {"activation_checkpointing": "true", "optimizer_offload": "cpu", "param_offload": "cpu",
         "attention_kernel": "fused", "nvme_path": "/nvme/x"}


@pytest.mark.parametrize("key", sorted(MOVED))
def test_old_plan_key_names_its_new_place(tmp_path, key):
    old = tmp_path / "old.yaml"
    old.write_text(f"plan:\n  {key}: {MOVED[key]}\n")
    with pytest.raises(ConfigError, match=rf"old.yaml:plan.{key}: this key moved to "
                                          rf"trainer.{key}"):
        load_config(old)


@pytest.mark.parametrize("key", ["activation_checkpointing", "optimizer_offload",
                                 "param_offload", "attention_kernel"])
def test_resume_check_covers_trainer_memory_keys(key):
    base = to_dict(load_config(None, []))
    changed = to_dict(load_config(None, [f"trainer.{key}={MOVED[key]}"]))
    diffs = config_differences(base, changed)
    assert len(diffs) == 1 and diffs[0].startswith(f"trainer.{key}: ")


def test_saved_config_with_old_plan_keys_compares_at_the_new_place():
    new = to_dict(load_config(None, ["trainer.optimizer_offload=cpu"]))
    old = to_dict(load_config(None, []))
    old["plan"]["optimizer_offload"] = "cpu"  # a config.yaml written before the move
    del old["trainer"]["optimizer_offload"]
    assert config_differences(old, new) == []
    new_nvme = to_dict(load_config(None, ["trainer.nvme_path=/elsewhere"]))
    assert config_differences(to_dict(load_config(None, [])), new_nvme) == []

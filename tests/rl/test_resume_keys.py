"""Every config key is classified by what changing it on resume does (`rl.resume.RESUME_KEYS`):
refused, accepted with a note, accepted silently, the schedule's horizon kept, or compared by
content. A key added later is refused until someone decides otherwise here."""
import hashlib
import json

import pytest
import yaml

from launch.checks import check_resume_or_exit
from rl.config import Config, load_config, save_config, to_dict
from rl.resume import (CONTENT, IGNORE, NOTE, REFUSE, SCHEDULE, _flatten, config_differences,
                       config_notes, key_kind, resume_hash, resume_hashes)

# Everything a resume accepts. Changing this set is a decision about what a resumed run computes.
ACCEPTED = {
    NOTE: {"trainer.torch_threads", "rollout.torch_threads", "rollout.cpu_kvcache_gb",
           "eval.every", "eval.num_prompts", "eval.pass_k", "eval.pass_k_temperature",
           "eval.at_start"},
    SCHEDULE: {"num_steps"},
    CONTENT: {"data.train_path", "data.eval_path"},
    IGNORE: {"name", "output_dir", "trainer.nvme_path", "sft.cache_dir", "sync.timeout_s",
             "sync.bucket_mb", "sync.verify", "sync.backend", "sync.check_logprobs",
             "sync.check_logprobs_tol", "reward.num_workers", "env.num_workers"},
}
IGNORED_SECTIONS = ("cluster.", "checkpoint.", "logging.", "plan.")


def _flat_default() -> dict:
    return _flatten(to_dict(Config()))


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, list):
        return [*value, "other"]
    if isinstance(value, dict):
        return {"OTHER": "1"}
    return "other"  # None


def _nest(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def test_the_keys_a_resume_accepts_are_exactly_the_listed_ones():
    flat = _flat_default()
    accepted = {k: key_kind(k, flat) for k in flat if key_kind(k, flat) != REFUSE}
    listed = {k: kind for kind, keys in ACCEPTED.items() for k in keys}
    sections = {k for k in accepted if k.startswith(IGNORED_SECTIONS)}
    assert all(accepted[k] == IGNORE for k in sections)
    assert {k: v for k, v in accepted.items() if k not in sections} == listed


@pytest.mark.parametrize("key", sorted(_flat_default()))
def test_changing_any_key_on_resume_does_what_its_class_says(key):
    """Each key changed alone (the config with a decaying schedule, so num_steps gets its note):
    refused keys are listed as differences, noted ones as notes, the rest neither."""
    flat = {**_flat_default(), "trainer.lr_schedule": "cosine"}
    old, new = _nest(flat), _nest({**flat, key: _changed(flat[key])})
    kind = key_kind(key, flat)
    diffs, notes = config_differences(old, new), config_notes(old, new)
    assert [d.split(":")[0] for d in diffs] == ([key] if kind == REFUSE else [])
    assert [n.split(":")[0] for n in notes] == ([key] if kind in (NOTE, SCHEDULE) else [])


def test_a_key_no_entry_covers_is_refused():
    assert key_kind("newsection.setting", {}) == REFUSE
    assert key_kind("sync.new_setting", {}) == REFUSE


def test_the_warm_start_settings_matter_only_with_a_warm_start():
    """sft.* builds the run's first weights and the KL reference model."""
    on, off = _flat_default(), {**_flat_default(), "model.warm_start": False}
    assert key_kind("sft.steps", on) == REFUSE and key_kind("sft.lr", on) == REFUSE
    assert key_kind("sft.steps", off) == IGNORE
    assert key_kind("sft.cache_dir", on) == IGNORE  # where, not what


def test_num_steps_is_noted_only_when_the_rate_decays():
    cosine = to_dict(load_config(None, ["trainer.lr_schedule=cosine", "num_steps=250"]))
    longer = to_dict(load_config(None, ["trainer.lr_schedule=cosine", "num_steps=500"]))
    assert config_differences(cosine, longer) == []
    (note,) = config_notes(cosine, longer)
    assert note.startswith("num_steps: 250 -> 500 (the cosine learning-rate schedule keeps the "
                           "horizon it had when the run started")
    constant = to_dict(load_config(None, ["num_steps=250"]))
    assert config_notes(constant, to_dict(load_config(None, ["num_steps=500"]))) == []


def test_launcher_prints_the_notes_and_resumes(tmp_path, capsys):
    cfg = load_config(None, [f"output_dir={tmp_path}", "trainer.lr_schedule=cosine",
                             "num_steps=250", "trainer.torch_threads=1"])
    cfg.run_dir.mkdir(parents=True)
    save_config(cfg, cfg.run_dir / "config.yaml")
    check_resume_or_exit(load_config(None, [f"output_dir={tmp_path}", "num_steps=500",
                                            "trainer.lr_schedule=cosine",
                                            "trainer.torch_threads=2"]), force=False)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("note: resuming with a changed setting: num_steps: 250 -> 500")
    assert out[1] == ("note: resuming with a changed setting: trainer.torch_threads: 1 -> 2 "
                      "(may change floating-point rounding, nothing else)")


def _legacy_hash(cfg: Config) -> str:
    """The config hash checkpoints written before RESUME_KEYS carry."""
    ignored = ("name", "output_dir", "num_steps", "eval", "logging", "checkpoint", "cluster",
               "sync.timeout_s", "sync.bucket_mb", "sync.verify", "trainer.torch_threads",
               "rollout.torch_threads", "rollout.cpu_kvcache_gb", "trainer.nvme_path", "sft",
               "plan", "reward.num_workers")
    defaults = _flat_default()
    flat = {k: v for k, v in _flatten(to_dict(cfg)).items()
            if not any(k == p or k.startswith(p + ".") for p in ignored)
            and defaults.get(k) != v}
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:16]


@pytest.mark.parametrize("overrides", [["sync.backend=gloo"], ["data.source=file",
                                                               "data.train_path=/d/t.jsonl"],
                                       ["sft.steps=10"], ["algorithm.clip_low=0.1"]])
def test_checkpoints_of_earlier_versions_stay_resumable(overrides):
    """A key reclassified since (sync.backend now ignored, data paths compared by content, sft
    refused with a warm start) changes the hash; the old one is still accepted."""
    cfg = load_config(None, overrides)
    assert _legacy_hash(cfg) in resume_hashes(cfg) and resume_hash(cfg) in resume_hashes(cfg)


def test_saved_config_yaml_round_trips_without_differences(tmp_path):
    cfg = load_config(None, ["trainer.lr_schedule=cosine"])
    save_config(cfg, tmp_path / "c.yaml")
    old = yaml.safe_load((tmp_path / "c.yaml").read_text())
    assert config_differences(old, to_dict(cfg)) == config_notes(old, to_dict(cfg)) == []

"""The SFT warm start's cache key: what a cached warm start is reused for."""
from pathlib import Path

from rl.config import load_config
from rl.models import presets
from rl.sft import sft_dir

REPO = Path(__file__).resolve().parents[2]


def _cfg(*overrides):
    return load_config(REPO / "configs" / "local.yaml", list(overrides))


def test_same_config_same_key_and_each_input_changes_it():
    key = sft_dir(_cfg())
    assert sft_dir(_cfg()) == key
    for override in ("seed=1", "sft.steps=171", "data.synthetic.num_train=2999",
                     "model.preset=tiny-deepseek-v4"):
        assert sft_dir(_cfg(override)) != key, override


def test_a_changed_preset_gets_a_new_key(monkeypatch):
    """A warm start trained from an earlier version of a preset is not reused after the preset's
    fields change (its base directory's fingerprint is part of the key)."""
    key = sft_dir(_cfg())
    model_type, fields = presets._BUILDERS["tiny-qwen3-moe"]
    monkeypatch.setitem(presets._BUILDERS, "tiny-qwen3-moe",
                        (model_type, lambda v: {**fields(v), "num_hidden_layers": 3}))
    assert sft_dir(_cfg()) != key


def test_data_keys_added_later_keep_existing_keys_at_their_defaults():
    """A config from before data.prompt_format (its dict lacks the key) and today's config at the
    defaults share a key, so cached warm starts stay valid; the mapping rl.sft strips is today's
    defaults, and a key off its default changes the key."""
    from rl.config import DataConfig, to_dict
    from rl.sft import _ADDED_DATA_KEYS, _sft_dir
    defaults = to_dict(DataConfig())
    assert {k: defaults[k] for k in _ADDED_DATA_KEYS} == _ADDED_DATA_KEYS
    cfg = _cfg()
    old = to_dict(cfg)
    old["data"] = {k: v for k, v in old["data"].items() if k not in _ADDED_DATA_KEYS}
    assert _sft_dir(old) == sft_dir(cfg)
    assert sft_dir(_cfg("data.prompt_format=chat_template")) != sft_dir(cfg)


def test_sft_keys_added_later_keep_existing_keys_at_their_defaults():
    """Likewise for the target-accuracy keys of SftConfig."""
    from rl.config import SftConfig, to_dict
    from rl.sft import _ADDED_SFT_KEYS, _sft_dir
    defaults = to_dict(SftConfig())
    assert {k: defaults[k] for k in _ADDED_SFT_KEYS} == _ADDED_SFT_KEYS
    cfg = _cfg()
    old = to_dict(cfg)
    old["sft"] = {k: v for k, v in old["sft"].items() if k not in _ADDED_SFT_KEYS}
    assert _sft_dir(old) == sft_dir(cfg)
    assert sft_dir(_cfg("sft.target_accuracy=0.3")) != sft_dir(cfg)

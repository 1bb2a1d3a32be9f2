import hashlib
import json

import pytest
import torch

from rl.models.loading import load_model, load_tokenizer
from rl.models.presets import PRESETS, build_model, build_preset, padded_vocab_size, preset_config
from rl.models.tokenizer import build_char_tokenizer
from tests.helpers.vllm import hf_greedy

# Parameter budgets (millions) that keep the CPU demo fast; qwen3-moe is the workhorse.
PARAM_RANGE_M = {"tiny-qwen3-moe": (1.0, 3.0), "tiny-deepseek-v3": (0.5, 3.0),
                 "tiny-deepseek-v4": (0.5, 4.0)}


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_preset_names_match_config_choices():
    from rl.config import MODEL_PRESETS
    assert set(PRESETS) == set(MODEL_PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_build_is_deterministic(name, preset_dirs, tmp_path):
    again = build_preset(name, tmp_path / "again", seed=0)
    other_seed = build_preset(name, tmp_path / "seed1", seed=1)
    first = preset_dirs[name]
    for file in ("model.safetensors", "config.json", "tokenizer.json"):
        assert _sha(first / file) == _sha(again / file), file
    assert _sha(first / "model.safetensors") != _sha(other_seed / "model.safetensors")


def test_build_refuses_existing_dir_and_leaves_no_temp_dirs(tmp_path):
    out = build_preset("tiny-qwen3-moe", tmp_path / "m")
    with pytest.raises(FileExistsError, match="already exists"):
        build_preset("tiny-qwen3-moe", out)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors",
                                               "tokenizer.json", "tokenizer_config.json"}


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown model preset 'tiny-llama'.*tiny-qwen3-moe"):
        preset_config("tiny-llama", 128)


@pytest.mark.parametrize("name", PRESETS)
def test_config_agrees_with_tokenizer(name, preset_dirs):
    tok = build_char_tokenizer()
    config = json.loads((preset_dirs[name] / "config.json").read_text())
    assert config["vocab_size"] == padded_vocab_size(len(tok)) == 128
    assert config["vocab_size"] % 64 == 0
    assert (config["pad_token_id"], config["bos_token_id"], config["eos_token_id"]) == (0, 1, 2)
    assert len(config["architectures"]) == 1


@pytest.mark.parametrize("name", PRESETS)
def test_hf_reload_is_exact_and_generates(name, preset_dirs):
    torch.set_num_threads(1)
    model = load_model(preset_dirs[name], torch.float32)
    reference = build_model(name, seed=0)
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for key in want:  # parameters and persistent buffers (tid2eid, e_score_correction_bias)
        assert torch.equal(got[key], want[key]), key
    low, high = PARAM_RANGE_M[name]
    assert low < sum(p.numel() for p in model.parameters()) / 1e6 < high

    tok = load_tokenizer(preset_dirs[name])
    ids = tok("12+34=", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 128) and torch.isfinite(logits).all()
    # Cached greedy decoding (generate) equals full-forward greedy decoding.
    out = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    tokens, _, margins = hf_greedy(model, ids[0].tolist(), 6)
    cached = out[0, ids.shape[1]:].tolist()
    agree = next((i for i, (a, b) in enumerate(zip(cached, tokens)) if a != b), len(tokens))
    assert agree == len(tokens) or margins[agree] < 1e-4, (cached, tokens)


def test_routing_buffers_are_seeded_not_constant(preset_dirs):
    v4 = build_model("tiny-deepseek-v4")
    (tid2eid,) = [b for n, b in v4.named_buffers() if n.endswith("tid2eid")]
    assert tid2eid.shape == (128, 2)
    assert (tid2eid[:, 0] != tid2eid[:, 1]).all()  # top_k distinct experts per token
    assert len(tid2eid.unique()) == 8  # all experts used
    for name in ("tiny-deepseek-v3", "tiny-deepseek-v4"):
        biases = [b for n, b in build_model(name).named_buffers()
                  if n.endswith("e_score_correction_bias")]
        assert biases and all(b.abs().sum() > 0 for b in biases)


@pytest.mark.parametrize("name", PRESETS)
def test_save_model_round_trips_a_loaded_model(name, preset_dirs, tmp_path):
    from rl.models.presets import save_model

    save_model(load_model(preset_dirs[name], torch.float32), tmp_path)
    assert _sha(tmp_path / "model.safetensors") == _sha(preset_dirs[name] / "model.safetensors")
    got = json.loads((tmp_path / "config.json").read_text())
    want = json.loads((preset_dirs[name] / "config.json").read_text())
    assert {k: v for k, v in got.items() if k != "_name_or_path"} == \
        {k: v for k, v in want.items() if k != "_name_or_path"}

"""Checkpoints are loaded with `torch.load(weights_only=True)` (`rl.safe_load`): what the run
writes loads back whole, a file with a planted object is refused before it runs, naming the file,
and RL_TRUST_CHECKPOINTS=1 is the documented way around it. (DeepSpeed's own files go through
the same loader: tests/rl/trainer/test_worker_checkpoint.py resumes real ZeRO ranks.)"""
import hashlib
import json
import os
import random

import numpy as np
import pytest
import torch

from rl import safe_load
from rl.config import load_config
from rl.pipeline import RolloutBatch
from rl.rollout.base import Sample
from rl.trainer.worker import rng_state
from tests.rl.test_checkpointer import _parts


class Planted:
    """What an attacker would put in a checkpoint: code that runs when it is unpickled."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_what_the_run_writes_loads_back_whole(tmp_path):
    """The driver's file with a batch generated ahead (numpy routing, version spans) and the
    trainer ranks' RNG file (numpy's Mersenne-Twister key)."""
    cfg = load_config(None, [f"output_dir={tmp_path}", "name=run"])
    ckpt, state, *_, pending, _trainer = _parts(cfg)
    routing = np.arange(24, dtype=np.uint16).reshape(4, 2, 3)
    sample = Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5], text="9", logprobs=[-0.5] * 3,
                    finish_reason="stop", weight_version=2, version_spans=[(0, 1), (2, 2)],
                    routing=routing)
    pending.state = [RolloutBatch(step=4, indices=[7], groups=[[sample]], seconds=1.5,
                                  ahead=1).to_state()]
    state.step = 3
    random.seed(11)
    path = ckpt.save()
    driver = safe_load.load(path / "driver.pt")
    assert driver["state"]["step"] == 3 and driver["python_rng"] == random.getstate()
    back = RolloutBatch.from_state(driver["pending"][0]).groups[0][0]
    assert np.array_equal(back.routing, routing) and back.routing.dtype == np.uint16
    assert back.version_spans == [(0, 1), (2, 2)]
    torch.save(rng_state(), tmp_path / "rng_rank_00000.pt")
    rng = safe_load.load(tmp_path / "rng_rank_00000.pt")
    assert rng["python"] == random.getstate()
    assert np.array_equal(rng["numpy"][1], np.random.get_state()[1])


def test_a_planted_object_is_refused_before_it_runs(tmp_path):
    cfg = load_config(None, [f"output_dir={tmp_path}", "name=run"])
    ckpt = _parts(cfg)[0]
    path = ckpt.save()
    marker = tmp_path / "pwned"
    driver = torch.load(path / "driver.pt", weights_only=True)
    driver["sampler"]["position"] = Planted(marker)
    torch.save(driver, path / "driver.pt")
    # whoever can write the file can rewrite the manifest's size and checksum of it too
    manifest = json.loads((path / "manifest.json").read_text())
    data = (path / "driver.pt").read_bytes()
    manifest["files"]["driver.pt"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(safe_load.UnsafeCheckpointError) as e:
        _parts(cfg)[0].load_latest(force=False)
    assert str(e.value).startswith(f"{path / 'driver.pt'}: refusing to load: it holds an object")
    assert "GLOBAL os.makedirs" in str(e.value) and "RL_TRUST_CHECKPOINTS=1" in str(e.value)
    assert not marker.exists()


def test_trusting_a_checkpoint_loads_it_anyway(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    torch.save({"x": Planted(marker)}, tmp_path / "f.pt")
    monkeypatch.setenv(safe_load.TRUST_ENV, "1")
    safe_load.load(tmp_path / "f.pt")
    assert marker.exists()  # which is why it is opt-in


def test_deepspeed_loads_through_the_safe_loader(tmp_path):
    class Engine:  # DeepSpeed's checkpoint engine: its other methods stay its own
        def load(self, path, map_location=None):
            return torch.load(path, map_location=map_location, weights_only=False)

        def is_decoupled(self):
            return False
    torch.save({"x": Planted(tmp_path / "ran")}, tmp_path / "f.pt")
    wrapped = safe_load.SafeCheckpointEngine(Engine())
    assert wrapped.is_decoupled() is False
    with pytest.raises(safe_load.UnsafeCheckpointError):
        wrapped.load(str(tmp_path / "f.pt"), map_location="cpu")
    assert not (tmp_path / "ran").exists()

"""The driver checkpoint is assembled from its parts' own state (`rl.checkpoint.Checkpointer`):
a save and a load restore every part, and driver.pt keeps the layout older runs wrote (their
checkpoints still resume)."""
import json
import logging
import random
from pathlib import Path

import pytest
import torch

from rl.checkpoint import MANIFEST, Checkpointer
from rl.checkpoint_files import seal_files, sha256_files
from rl.config import ConfigError, load_config
from rl.data.sampler import PromptSampler
from rl.evaluate import Evaluator
from rl.loop import TrainState
from rl.publisher import WeightPublisher
from rl.rewards.computer import RewardComputer

# driver.pt's `state` keys as the driver has always written them (DriverState before the split)
DRIVER_STATE_KEYS = {"step", "weight_version", "warm_start_accuracy", "last_eval", "skipped_steps",
                     "bad_in_a_row", "restarts_before", "reward_failures_before",
                     "dropped_samples", "eval_pending"}
ADDED_KEYS = {"generated_tokens"}
"""Keys added since; an older checkpoint lacks them (`TrainState` keeps their default)."""


class _Trainer:
    """A trainer group of one rank that writes (and seals) one shard file."""

    def __init__(self):
        self.saved, self.loaded = [], []

    def save(self, path, tag, client_state, checksum=True):
        self.saved.append(client_state)
        (Path(path) / tag).mkdir(parents=True)
        (Path(path) / tag / "shard.pt").write_bytes(b"weights" * 100)
        files, seconds = seal_files(Path(path), [f"{tag}/shard.pt"], checksum)
        return {"files": {rel: {**rec, "rank": 0} for rel, rec in files.items()},
                "seconds": seconds}

    def sha256(self, path, by_rank):
        return sha256_files(Path(path), by_rank[0])

    def load(self, path, tag):
        self.loaded.append(path)


class _Pending:
    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


class _Runtime:
    restarts = 2


def _parts(cfg):
    state, rewards = TrainState(), RewardComputer(cfg.reward)
    publisher = WeightPublisher(cfg, _Runtime(), ([1], [2]), lambda: state.step + 1)
    evaluator = Evaluator(cfg, None, None, publisher)
    sampler, pending, trainer = PromptSampler(10, 0), _Pending([]), _Trainer()
    ckpt = Checkpointer(cfg, trainer, [state, publisher, evaluator, rewards], sampler, pending,
                        "hash1")
    return ckpt, state, publisher, evaluator, rewards, sampler, pending, trainer


def test_save_and_load_restore_every_part(tmp_path):
    cfg = load_config(None, [f"output_dir={tmp_path}", "name=run"])
    ckpt, state, publisher, evaluator, rewards, sampler, pending, trainer = _parts(cfg)
    state.step, state.skipped_steps, state.dropped_samples = 3, 1, 4
    state.generated_tokens = 1234
    publisher.weight_version, publisher.restarts_before = 3, 1
    evaluator.last, evaluator.pending = {"eval/pass1": 0.5}, 3
    rewards.failures = 7
    sampler.next_indices(4)
    pending.state = [{"step": 4}]
    random.seed(5)
    path = ckpt.save()
    assert trainer.saved == [{"step": 3}] and ckpt.last_saved_step == 3
    driver = torch.load(path / "driver.pt", weights_only=False)
    assert set(driver["state"]) == DRIVER_STATE_KEYS | ADDED_KEYS
    assert driver["state"]["restarts_before"] == 3  # this life's restarts are carried over
    expected_draw = random.random()

    cfg2 = load_config(None, [f"output_dir={tmp_path}", "name=run"])
    ckpt2, state2, publisher2, evaluator2, rewards2, sampler2, pending2, trainer2 = _parts(cfg2)
    assert ckpt2.load_latest(force=False) == path and trainer2.loaded
    assert (state2.step, state2.skipped_steps, state2.dropped_samples) == (3, 1, 4)
    assert state2.generated_tokens == 1234
    assert (publisher2.weight_version, publisher2.restarts_before) == (3, 3)
    assert evaluator2.last == {"eval/pass1": 0.5} and evaluator2.pending == 3
    assert rewards2.failures == 7 and pending2.state == [{"step": 4}]
    assert sampler2.state_dict() == sampler.state_dict() and ckpt2.last_saved_step == 3
    assert random.random() == expected_draw


def test_a_checkpoint_of_another_config_is_refused_unless_forced(tmp_path):
    cfg = load_config(None, [f"output_dir={tmp_path}", "name=run"])
    ckpt = _parts(cfg)[0]
    ckpt.save()
    other = _parts(cfg)[0]
    other.config_hash = "hash2"
    with pytest.raises(ConfigError, match="refusing to resume from step_000000"):
        other.load_latest(force=False)
    assert other.load_latest(force=True) is not None


def test_a_truncated_newest_driver_pt_falls_back_to_the_older_checkpoint(tmp_path, caplog):
    cfg = load_config(None, [f"output_dir={tmp_path}", "name=run"])
    ckpt, state, *_ = _parts(cfg)
    for step in (3, 6):
        state.step = step
        ckpt.save()
    newest = cfg.run_dir / "checkpoints" / "step_000006"
    driver = newest / "driver.pt"
    size = driver.stat().st_size
    driver.write_bytes(driver.read_bytes()[:100])  # e.g. a node lost while the page cache held it

    resumed, state2, *_, trainer2 = _parts(cfg)
    with caplog.at_level(logging.INFO, logger="rl.checkpoint"):
        path = resumed.load_latest(force=False)
    assert path.name == "step_000003" and state2.step == 3
    assert trainer2.loaded == [str(path / "trainer")]
    assert f"skipping checkpoint step_000006: truncated file driver.pt (100 of {size} bytes)" \
        in caplog.text
    assert "hashed 2 files (0.00 GB) of step_000003 to check their SHA-256" in caplog.text
    files = json.loads((path / MANIFEST).read_text())["files"]
    assert set(files) == {"driver.pt", "trainer/ds/shard.pt"}
    assert files["trainer/ds/shard.pt"]["rank"] == 0 and files["driver.pt"]["rank"] == "driver"

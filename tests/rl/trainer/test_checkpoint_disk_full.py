"""Trainer checkpoints with real DeepSpeed ranks: every rank seals (fsync + SHA-256) the files it
wrote, the resume's checksums are computed by the ranks, and a disk that fills up during a save
(a real small tmpfs: ENOSPC in the middle of DeepSpeed's writes) fails the save on every rank
without leaving one waiting in a collective; the temporary directory is gone at once, the older
checkpoint intact, and the run can save again once there is room.

Two ZeRO-2 ranks in plain processes (gloo), the Checkpointer as the driver uses it."""
import errno
import json
import logging
import re

import pytest

from rl.checkpoint import MANIFEST, Checkpointer
from rl.cluster.facades import TrainerGroup
from rl.config import ModelConfig, load_config
from rl.data.sampler import PromptSampler
from rl.loop import TrainState
from rl.models.loading import resolve_model_dir
from tests.helpers.small_fs import fill, free_bytes, small_tmpfs
from tests.rl.test_checkpointer import _Pending
from tests.rl.trainer.test_worker_checkpoint import _ranks

pytestmark = pytest.mark.slow


class _Version:
    def state_dict(self):
        return {"weight_version": 0}

    def load_state_dict(self, state):
        pass


def _checkpointer(out_dir, group):
    cfg = load_config(None, [f"output_dir={out_dir}", "name=run", "checkpoint.keep_last=2"])
    state = TrainState()
    return Checkpointer(cfg, group, [state, _Version()], PromptSampler(10, 0), _Pending([]),
                        "h"), state


@pytest.mark.timeout(900)
def test_disk_full_during_a_trainer_save_fails_cleanly_on_every_rank(tmp_path, caplog):
    model_dir = resolve_model_dir(ModelConfig(preset="tiny-qwen3-moe"), tmp_path / "models")
    ranks = _ranks(model_dir, 2, seed=0, name="disk")
    try:
        group = TrainerGroup(ranks)
        # The checkpoint's size, on an ordinary disk; each rank listed the files it wrote.
        probe, state = _checkpointer(tmp_path / "probe", group)
        state.step = 1
        manifest = json.loads((probe.save() / MANIFEST).read_text())
        files = manifest["files"]
        size = sum(f["bytes"] for f in files.values())
        writers = {f["rank"] for f in files.values()}
        assert writers == {0, 1, "driver"}, writers
        assert all(len(f["sha256"]) == 64 for f in files.values())
        assert any(r.startswith("trainer/ds/") and f["rank"] == 1 for r, f in files.items())

        with small_tmpfs(tmp_path, int(2.5 * size)) as fs:
            ckpt, state = _checkpointer(fs, group)
            state.step = 1
            ckpt.save()
            filler = fill(fs, leave_bytes=size // 2)  # the next save runs out half-way
            free = free_bytes(fs)
            state.step = 2
            with caplog.at_level(logging.ERROR, logger="rl.checkpoint"), \
                    pytest.raises((OSError, RuntimeError)) as e:
                ckpt.save()
            # torch.save's zip writer reports ENOSPC as a short write ("unexpected pos")
            assert getattr(e.value, "errno", None) == errno.ENOSPC or "unexpected pos" in str(
                e.value), e.value
            assert re.search(r"checkpoint step_000002 not written .*; 0\.0\d\d GB free on ",
                             caplog.text), caplog.text
            root = fs / "run" / "checkpoints"
            assert not list(root.glob(".tmp-*")) and free_bytes(fs) == free
            assert ckpt.manager.complete_steps() == [1]
            # The ranks are not stuck in a collective: they verify step 1 (each its own files)
            assert ckpt.manager.newest_intact(ckpt._digests)[0].name == "step_000001"
            filler.unlink()
            ckpt.save()  # room again: the run goes on
            resumed, state2 = _checkpointer(fs, group)
            assert resumed.load_latest(force=False).name == "step_000002" and state2.step == 2
    finally:
        for a in ranks:
            a.close()

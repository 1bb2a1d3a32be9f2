"""Checkpoints that prove themselves (CheckpointManager alone, tiny payloads): the manifest lists
every file's size and SHA-256; a resume skips damaged checkpoints newest first, one line each,
and moves them aside; none intact is one clear error; old checkpoints without a file list still
load; a failed save (a real full disk: a small tmpfs) removes its temporary directory at once."""
import errno
import hashlib
import json
import logging

import pytest

from rl.checkpoint import DAMAGED, MANIFEST, CheckpointManager, NoIntactCheckpoint, step_dir_name
from rl.checkpoint_files import sha256_files
from rl.config import ConfigError
from tests.helpers.small_fs import fill, free_bytes, small_tmpfs


def save(mgr, step, nbytes=100):
    def payload(tmp):
        (tmp / "driver.txt").write_text(f"state of step {step}")
        (tmp / "trainer" / "ds").mkdir(parents=True)
        (tmp / "trainer" / "ds" / "shard.bin").write_bytes(bytes([step % 256]) * nbytes)
    return mgr.save(step, weight_version=step, config_hash="h", write_payload=payload)


def digests(path, files):
    return sha256_files(path, list(files))


def test_manifest_lists_every_file_with_its_size_and_sha256(tmp_path):
    mgr = CheckpointManager(tmp_path)

    def payload(tmp):  # one file sealed by its "writer", the others left to the manager
        (tmp / "a.bin").write_bytes(b"a" * 10)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.bin").write_bytes(b"b" * 20)
        return {"a.bin": {"bytes": 10, "sha256": hashlib.sha256(b"a" * 10).hexdigest(),
                          "rank": 0}}
    path = mgr.save(1, 1, "h", payload)
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["format"] == 2 and manifest["checksum"] == "sha256"
    assert manifest["files"] == {
        "a.bin": {"bytes": 10, "sha256": hashlib.sha256(b"a" * 10).hexdigest(), "rank": 0},
        "sub/b.bin": {"bytes": 20, "sha256": hashlib.sha256(b"b" * 20).hexdigest(),
                      "rank": "driver"}}
    off = CheckpointManager(tmp_path / "off", checksums=False)
    files = json.loads((save(off, 1) / MANIFEST).read_text())["files"]
    assert files["driver.txt"] == {"bytes": len("state of step 1"), "rank": "driver"}


def _truncate(path):
    f = path / "trainer" / "ds" / "shard.bin"
    f.write_bytes(f.read_bytes()[:40])
    return "truncated file trainer/ds/shard.bin (40 of 100 bytes)"


def _flip(path):
    f = path / "trainer" / "ds" / "shard.bin"
    data = bytearray(f.read_bytes())
    data[50] ^= 0xFF
    f.write_bytes(bytes(data))
    return "checksum mismatch in trainer/ds/shard.bin"


def _delete(path):
    (path / "driver.txt").unlink()
    return "missing file driver.txt"


def _no_manifest(path):
    (path / MANIFEST).unlink()
    return f"no {MANIFEST}"


@pytest.mark.parametrize("damage", [_truncate, _flip, _delete, _no_manifest])
def test_resume_falls_back_past_a_damaged_newest_checkpoint(tmp_path, caplog, damage):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    for step in (4, 8):
        save(mgr, step)
    why = damage(mgr.root / step_dir_name(8))
    with caplog.at_level(logging.INFO, logger="rl.checkpoint"):
        path, manifest = mgr.newest_intact(digests)
    assert path.name == step_dir_name(4) and manifest["step"] == 4
    assert f"skipping checkpoint step_000008: {why}" in caplog.text
    # moved aside: no later resume or retention counts it; removed once step 8 is written again
    assert mgr.complete_steps() == [4]
    aside = list((mgr.root / DAMAGED).iterdir())
    assert [d.name.split("-")[0] for d in aside] == ["step_000008"]
    assert mgr.newest_intact(digests)[0].name == step_dir_name(4)
    save(mgr, 8)
    assert not aside[0].exists() and mgr.complete_steps() == [4, 8]


def test_no_intact_checkpoint_is_one_clear_error_and_nothing_moves(tmp_path):
    mgr = CheckpointManager(tmp_path)
    for step in (4, 8):
        save(mgr, step)
    _flip(mgr.root / step_dir_name(8))
    _truncate(mgr.root / step_dir_name(4))
    with pytest.raises(NoIntactCheckpoint) as e:
        mgr.newest_intact(digests)
    assert isinstance(e.value, ConfigError)  # exit 2, no requeue: the user decides
    msg = str(e.value)
    assert "\n" not in msg and "--no-resume" in msg
    assert ("step_000008: checksum mismatch in trainer/ds/shard.bin; step_000004: truncated "
            "file trainer/ds/shard.bin (40 of 100 bytes)") in msg
    assert mgr.complete_steps() == [4, 8] and not (mgr.root / DAMAGED).exists()


def test_a_run_directory_without_checkpoints_starts_fresh(tmp_path):
    assert CheckpointManager(tmp_path).newest_intact(digests) is None


def test_checkpoints_from_before_the_file_list_still_load_unverified(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path)
    old = mgr.root / step_dir_name(5)  # as the format-1 code wrote it: no `files`, no `format` 2
    old.mkdir()
    (old / "driver.pt").write_bytes(b"x")
    (old / MANIFEST).write_text(json.dumps({"format": 1, "step": 5, "weight_version": 5,
                                            "config_hash": "h"}))
    with caplog.at_level(logging.WARNING, logger="rl.checkpoint"):
        path, manifest = mgr.newest_intact(digests)
    assert path == old and manifest["step"] == 5
    assert ("checkpoint step_000005 was written before checkpoints listed their files "
            "(format 1): loading it unverified") in caplog.text


def test_a_failed_save_removes_its_temporary_directory_at_once(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path)
    save(mgr, 3)

    def payload(tmp):
        (tmp / "driver.txt").write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")
    with caplog.at_level(logging.ERROR, logger="rl.checkpoint"), pytest.raises(OSError):
        mgr.save(6, 6, "h", payload)
    assert not list(mgr.root.glob(".tmp-*"))
    assert mgr.complete_steps() == [3]
    assert (mgr.root / "latest").read_text().strip() == step_dir_name(3)
    assert "checkpoint step_000006 not written (OSError: [Errno 28] No space left" in caplog.text


def test_disk_full_during_a_save_leaves_the_older_checkpoints_and_frees_the_space(tmp_path):
    with small_tmpfs(tmp_path, 512 * 1024) as fs:
        mgr = CheckpointManager(fs / "run", keep_last=2)
        save(mgr, 3, nbytes=64 * 1024)
        filler = fill(fs, leave_bytes=32 * 1024)  # less than the next checkpoint needs
        free = free_bytes(fs)
        with pytest.raises(OSError) as e:
            save(mgr, 6, nbytes=64 * 1024)
        assert e.value.errno == errno.ENOSPC
        assert not list(mgr.root.glob(".tmp-*")) and free_bytes(fs) == free
        assert mgr.complete_steps() == [3]
        assert (mgr.root / "latest").read_text().strip() == step_dir_name(3)
        assert mgr.newest_intact(digests)[0].name == step_dir_name(3)
        filler.unlink()  # the disk has room again: the next save succeeds
        save(mgr, 6, nbytes=64 * 1024)
        assert mgr.newest_intact(digests)[0].name == step_dir_name(6)


def test_set_aside_after_moves_the_newer_checkpoints_and_keeps_them(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    for step in (3, 6, 9):
        save(mgr, step)
    moved = mgr.set_aside_after(3)
    assert sorted(d.name.split("-")[0] for d in moved) == ["step_000006", "step_000009"]
    assert all(d.parent.name == "abandoned" and (d / MANIFEST).is_file() for d in moved)
    assert mgr.complete_steps() == [3] and mgr.newest_intact(digests)[0].name == "step_000003"
    assert (mgr.root / "latest").read_text().strip() == "step_000003"
    save(mgr, 6)  # the new history; the abandoned one stays until someone deletes it
    assert mgr.complete_steps() == [3, 6] and all(d.exists() for d in moved)

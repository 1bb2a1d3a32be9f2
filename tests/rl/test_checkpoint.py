"""CheckpointManager on its own: retention (keep_last, keep_every), the `latest` pointer, and
incomplete or interrupted checkpoints skipped with a warning. Tiny payloads, no trainer."""
import json
import logging

import pytest

from rl.checkpoint import MANIFEST, CheckpointManager, step_dir_name


def save(mgr, step):
    def payload(tmp):
        (tmp / "driver.txt").write_text(f"state of step {step}")
    return mgr.save(step, weight_version=step, config_hash="h", write_payload=payload)


def on_disk(mgr):
    return sorted(p.name for p in mgr.root.iterdir() if p.name != "latest")


def test_keep_last_keeps_the_newest_and_latest_points_at_the_newest(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (3, 6, 9, 12):
        save(mgr, step)
    assert on_disk(mgr) == ["step_000009", "step_000012"]
    assert (mgr.root / "latest").read_text().strip() == "step_000012"
    path, manifest = mgr.latest()
    assert path.name == "step_000012" and manifest["step"] == 12 and manifest["weight_version"] == 12
    assert (path / "driver.txt").read_text() == "state of step 12"


def test_keep_every_keeps_multiples_forever_besides_the_last(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=1, keep_every=10)
    for step in range(5, 40, 5):
        save(mgr, step)
    assert mgr.complete_steps() == [10, 20, 30, 35]
    assert on_disk(mgr) == [step_dir_name(s) for s in (10, 20, 30, 35)]


def test_incomplete_checkpoint_is_skipped_with_a_warning(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    save(mgr, 4)
    save(mgr, 8)
    # A newer step directory without its manifest (the write order makes the manifest last).
    newest = mgr.root / step_dir_name(12)
    newest.mkdir()
    (newest / "driver.txt").write_text("half written")
    # And an interrupted write that never got renamed into place.
    (mgr.root / ".tmp-step_000016-deadbeef").mkdir()
    with caplog.at_level(logging.WARNING, logger="rl.checkpoint"):
        path, manifest = mgr.latest()
    assert path.name == "step_000008" and manifest["step"] == 8
    assert f"skipping checkpoint {newest.name}: no {MANIFEST}" in caplog.text
    assert mgr.complete_steps() == [4, 8]


def test_unreadable_manifest_is_skipped_with_a_warning(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    save(mgr, 4)
    broken = save(mgr, 8)
    (broken / MANIFEST).write_text('{"step": 8,')
    with caplog.at_level(logging.WARNING, logger="rl.checkpoint"):
        path, _ = mgr.latest()
    assert path.name == "step_000004"
    assert f"skipping checkpoint {broken.name}: unreadable {MANIFEST}" in caplog.text


def test_interrupted_writes_are_reported_then_cleaned_by_the_next_save(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path)
    tmp = mgr.root / ".tmp-step_000003-0badf00d"
    tmp.mkdir()
    with caplog.at_level(logging.WARNING, logger="rl.checkpoint"):
        assert mgr.latest() is None
    assert f"ignoring interrupted checkpoint write {tmp}" in caplog.text
    save(mgr, 3)
    assert on_disk(mgr) == ["step_000003"]


def test_saving_a_step_again_replaces_it(tmp_path):
    mgr = CheckpointManager(tmp_path)
    save(mgr, 5)
    path = mgr.save(5, weight_version=6, config_hash="h2", write_payload=lambda tmp: None)
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["weight_version"] == 6 and manifest["config_hash"] == "h2"
    assert {"python", "torch"} <= set(manifest["versions"])
    assert not (path / "driver.txt").exists()  # the old payload is gone
    assert on_disk(mgr) == ["step_000005"]


@pytest.mark.parametrize("keep_last", [1, 3])
def test_the_newest_checkpoint_is_never_removed(tmp_path, keep_last):
    mgr = CheckpointManager(tmp_path, keep_last=keep_last, keep_every=4)
    for step in range(1, 8):
        save(mgr, step)
        assert mgr.latest()[0].name == step_dir_name(step)

"""The run directory is created 0700 and checkpoints 0700 / 0600 whatever the umask; nobody else
may write an existing run directory; a run directory or a temporary directory another user owns,
or a temporary one open to others, is refused."""
import os
import stat
import tempfile
from pathlib import Path

import pytest

from rl import private_files
from rl.checkpoint import CheckpointManager
from rl.config import ConfigError


@pytest.fixture
def open_umask():
    """umask 0: every file and directory created without an explicit mode is world-writable."""
    previous = os.umask(0)
    yield
    os.umask(previous)


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_run_dir_is_created_0700_and_nobody_else_may_write_an_existing_one(tmp_path,
                                                                          open_umask):
    path = private_files.run_dir(tmp_path / "out" / "run")
    assert _mode(path) == 0o700
    os.chmod(path, 0o750)  # opened to a group for TensorBoard: stays so
    private_files.run_dir(path)
    assert _mode(path) == 0o750
    os.chmod(path, 0o777)
    private_files.run_dir(path)
    assert _mode(path) == 0o755


def test_checkpoint_files_are_private_whatever_the_umask(tmp_path, open_umask):
    def payload(tmp):  # what DeepSpeed and torch.save do: plain creates, umask modes
        (tmp / "trainer" / "ds").mkdir(parents=True)
        (tmp / "trainer" / "ds" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x")
        (tmp / "driver.pt").write_bytes(b"y")
    mgr = CheckpointManager(tmp_path / "run")
    step = mgr.save(1, 1, "hash", payload)
    assert _mode(mgr.root) == 0o700
    modes = {p.relative_to(step).as_posix(): _mode(p) for p in [step, *step.rglob("*")]}
    assert modes == {".": 0o700, "trainer": 0o700, "trainer/ds": 0o700, "driver.pt": 0o600,
                     "trainer/ds/zero_pp_rank_0_mp_rank_00_optim_states.pt": 0o600,
                     "manifest.json": 0o600}
    assert _mode(mgr.root / "latest") == 0o600


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory another user's")
def test_a_directory_another_user_owns_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ConfigError, match=f"{theirs}: owned by uid 65534, not by this user"):
        private_files.run_dir(theirs)
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        private_files.temp_dir(theirs, "rl-ray-")


def test_temp_dirs_are_fresh_or_checked(tmp_path, open_umask, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # mkdtemp's default directory
    fresh = private_files.temp_dir(None, "rl-ray-")
    assert fresh.parent == tmp_path and fresh.name.startswith("rl-ray-")
    assert _mode(fresh) == 0o700
    assert private_files.temp_dir(None, "rl-ray-") != fresh  # unpredictable, never reused
    assert _mode(private_files.temp_dir(tmp_path / "given", "x")) == 0o700
    (tmp_path / "open").mkdir(mode=0o777)
    with pytest.raises(ConfigError, match="mode 777 lets other users in; expected 700"):
        private_files.temp_dir(tmp_path / "open", "x")
    (tmp_path / "link").symlink_to(tmp_path / "given")
    with pytest.raises(ConfigError, match="link: not a directory \\(a symlink or a file\\)"):
        private_files.temp_dir(tmp_path / "link", "x")


def test_launcher_makes_the_run_directory_private(tmp_path, monkeypatch, open_umask):
    import launch.submit
    monkeypatch.setattr(launch.submit, "run_local", lambda cfg, args: 0)
    local = str(Path(__file__).resolve().parents[2] / "configs" / "local.yaml")
    assert launch.submit.main([local, f"output_dir={tmp_path}", "name=r"]) == 0
    assert _mode(tmp_path / "r") == 0o700

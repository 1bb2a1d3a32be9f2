"""Each node's Ray temp dir (/tmp/rlray-JOB-NODE, a predictable name in a shared /tmp) is made
on the node by the srun step's shell: 0700 when absent, refused when it is a symlink or another
user's. The shell is run here directly, no Slurm needed."""
import os
import stat
import subprocess

import pytest

from slurm.ray_cluster import private_dir_sh


def _run(path):
    return subprocess.run(["sh", "-c", private_dir_sh(path)], capture_output=True, text=True,
                          timeout=30)


def test_absent_dir_is_made_0700_and_an_own_one_tightened(tmp_path):
    old = os.umask(0)
    try:
        assert _run(tmp_path / "new").returncode == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(tmp_path / "new").st_mode) == 0o700
    (tmp_path / "mine").mkdir(mode=0o755)
    assert _run(tmp_path / "mine").returncode == 0
    assert stat.S_IMODE(os.lstat(tmp_path / "mine").st_mode) == 0o700


def test_a_symlink_or_a_file_is_refused(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    (tmp_path / "file").write_text("")
    for name in ("link", "file"):
        proc = _run(tmp_path / name)
        assert proc.returncode == 1 and "refusing Ray temp dir" in proc.stderr


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory another user's")
def test_another_users_dir_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    os.chown(theirs, 65534, 65534)
    proc = _run(theirs)
    assert proc.returncode == 1 and f"refusing Ray temp dir {theirs}" in proc.stderr

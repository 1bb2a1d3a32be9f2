"""Directories and files only this user can read, whatever the umask.

A run directory holds checkpoints (which a resume loads), the run's config, its data fingerprint
and Ray's auth token: `run_dir` creates it 0700, takes write access for others away from one
that exists, and refuses one another user owns (they could plant or swap its files).
Checkpoints are 0700 / 0600 themselves (`make_private`), so that opening the run directory to a
group, to share TensorBoard, does not open them.

`temp_dir` is for scratch directories in a shared /tmp (Ray's session files and sockets): a
fresh one from `mkdtemp` (0700, unpredictable name), or a given path that must be a directory
this user owns with no access for others, never a symlink.
"""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from rl.config import ConfigError

DIR_MODE, FILE_MODE = 0o700, 0o600


def _check_owner(path: Path, st: os.stat_result) -> None:
    if st.st_uid != os.getuid():
        raise ConfigError(f"{path}: owned by uid {st.st_uid}, not by this user (uid "
                          f"{os.getuid()}); refusing to use it: choose another output_dir or name")


def run_dir(path: str | Path) -> Path:
    """Create `path` 0700 (missing parents with the default mode). One that exists keeps the
    read access its owner gave it (a group reading TensorBoard), but not write access for
    others: they could swap its files. ConfigError when it is not a directory or another user
    owns it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir()
        os.chmod(path, DIR_MODE)  # mkdir's mode passes through the umask: set it exactly
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{path}: not a directory (a symlink or a file); expected the run "
                          "directory")
    _check_owner(path, st)
    if stat.S_IMODE(st.st_mode) & 0o022:
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o022)
    return path


def make_private(root: str | Path) -> None:
    """`root` and everything under it: directories 0700, files 0600 (symlinks are left alone)."""
    os.chmod(root, DIR_MODE)
    for parent, dirs, files in os.walk(root):
        for name, mode in [(d, DIR_MODE) for d in dirs] + [(f, FILE_MODE) for f in files]:
            path = os.path.join(parent, name)
            if not os.path.islink(path):
                os.chmod(path, mode)


def temp_dir(path: str | Path | None, prefix: str) -> Path:
    """A scratch directory only this user can use: a fresh `mkdtemp` (under $TMPDIR or /tmp)
    when `path` is None; else `path`, created 0700 if absent, refused (ConfigError) when it is a
    symlink, not a directory, another user's, or open to others."""
    if path is None:
        return Path(tempfile.mkdtemp(prefix=prefix))
    path = Path(path)
    try:
        path.mkdir(mode=DIR_MODE)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{path}: not a directory (a symlink or a file); refusing it as a "
                          "temporary directory")
    _check_owner(path, st)
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise ConfigError(f"{path}: mode {stat.S_IMODE(st.st_mode):o} lets other users in; "
                          f"expected 700 (chmod 700 {path})")
    return path

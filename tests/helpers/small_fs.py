"""A real, small file system for disk-full tests: a tmpfs of a few hundred KiB (needs root to
mount; the test is skipped otherwise). Writes past its size fail with ENOSPC, as on a full disk."""
import contextlib
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest


@contextlib.contextmanager
def small_tmpfs(parent: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of `size_bytes` (rounded up to pages) mounted at `parent`/small_fs."""
    mnt = Path(parent) / "small_fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs",
                        str(mnt)], capture_output=True, text=True)
    if r.returncode:
        mnt.rmdir()
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        mnt.rmdir()


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: Path, leave_bytes: int) -> Path:
    """A file taking all of `path`'s file system but `leave_bytes`."""
    filler = Path(path) / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free_bytes(path) - leave_bytes))
    return filler

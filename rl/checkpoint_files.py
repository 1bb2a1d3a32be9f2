"""The files of a checkpoint: made durable and checksummed by the process that wrote them, and
checked again before a resume.

`seal(path)` reads a file once, streaming, hashing it with SHA-256 (the digest `sha256sum`
prints), and fsyncs it; `seal_files` does that for many files on a few threads (hashlib releases
the GIL) and fsyncs their directories. Each trainer rank seals the files it wrote (on its own node,
where they are still in the page cache), all ranks at once; the driver seals its own and whatever no
rank claimed. The manifest maps each file's path (relative to the checkpoint directory) to
`{"bytes": n, "sha256": hex, "rank": writer}`; with `checkpoint.checksums: false` the digest is
left out and only sizes are checked.

`problem(root, files, digests)` is the check on resume: one short reason (missing file, truncated,
checksum mismatch) or None.
"""
from __future__ import annotations

import gc
import hashlib
import os
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CHUNK = 8 << 20
"""Bytes read per hash update: large enough to amortise the call, small enough to stream."""
THREADS = 4
"""Files sealed at once by one process (a rank writes a few large files)."""
UNREADABLE = "unreadable: "


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal(path: Path, checksum: bool = True) -> dict:
    """fsync `path` and return {"bytes": size, "sha256": hex digest (when `checksum`)}."""
    h = hashlib.sha256() if checksum else None
    size = 0
    with open(path, "rb", buffering=0) as f:
        if h is not None:
            buf = bytearray(CHUNK)
            view = memoryview(buf)
            while n := f.readinto(buf):
                h.update(view[:n])
                size += n
        else:
            size = os.fstat(f.fileno()).st_size
        os.fsync(f.fileno())
    return {"bytes": size, **({"sha256": h.hexdigest()} if h is not None else {})}


def seal_files(root: Path, relpaths: list[str], checksum: bool = True,
               threads: int = THREADS) -> tuple[dict[str, dict], float]:
    """`seal` every `root/relpath`, then fsync the directories that hold them (up to `root`);
    returns ({relpath: record}, seconds)."""
    t0 = time.perf_counter()
    root = Path(root)
    with ThreadPoolExecutor(max(1, min(threads, len(relpaths)))) as pool:
        records = dict(zip(relpaths, pool.map(lambda r: seal(root / r, checksum), relpaths)))
    dirs = {root}
    for rel in relpaths:
        parent = (root / rel).parent
        while parent != root and root in parent.parents:
            dirs.add(parent)
            parent = parent.parent
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):  # innermost first
        fsync_dir(d)
    return records, time.perf_counter() - t0


def sha256_files(root: Path, relpaths: list[str], threads: int = THREADS) -> dict[str, str]:
    """{relpath: SHA-256 hex digest} of files under `root`; a file that cannot be read maps to
    `UNREADABLE` + the error."""
    def one(rel: str) -> str:
        h = hashlib.sha256()
        try:
            with open(Path(root) / rel, "rb", buffering=0) as f:
                buf = bytearray(CHUNK)
                view = memoryview(buf)
                while n := f.readinto(buf):
                    h.update(view[:n])
        except OSError as e:
            return f"{UNREADABLE}{e.strerror or e}"
        return h.hexdigest()
    if not relpaths:
        return {}
    with ThreadPoolExecutor(max(1, min(threads, len(relpaths)))) as pool:
        return dict(zip(relpaths, pool.map(one, relpaths)))


def list_files(root: Path) -> list[str]:
    """Every regular file under `root`, as a sorted list of paths relative to it."""
    root = Path(root)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def size_problem(root: Path, files: dict[str, dict]) -> str | None:
    """The first file of the manifest's `files` that is missing or has another size (cheap:
    one stat a file), as a reason; None when all are there with their sizes."""
    for rel, rec in sorted(files.items()):
        try:
            size = (Path(root) / rel).stat().st_size
        except FileNotFoundError:
            return f"missing file {rel}"
        except OSError as e:
            return f"unreadable file {rel} ({e.strerror or e})"
        if size != rec["bytes"]:
            return f"truncated file {rel} ({size} of {rec['bytes']} bytes)"
    return None


def digest_problem(files: dict[str, dict], digests: dict[str, str]) -> str | None:
    """The first file whose digest differs from the manifest's, as a reason."""
    for rel in sorted(digests):
        got = digests[rel]
        if got.startswith(UNREADABLE):
            return f"unreadable file {rel} ({got.removeprefix(UNREADABLE)})"
        if got != files[rel].get("sha256", got):
            return f"checksum mismatch in {rel}"
    return None


def release_files(error: BaseException) -> None:
    """Let go of the files a failed write left open. torch.save's zip writer closes its file
    only when the writer object dies, and the error's traceback keeps it alive: on a full disk
    the space of a removed file then stays taken (tmpfs, local disks) or the directory cannot
    be removed at all (NFS keeps the open file as .nfsXXXX). Clears the traceback's finished
    frames (their line numbers stay for the report)."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        stack += [e.__context__, e.__cause__]
    gc.collect()

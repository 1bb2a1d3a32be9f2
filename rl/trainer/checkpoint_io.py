"""Which files of a trainer checkpoint this rank wrote, so that it can fsync and checksum them
itself (`rl.checkpoint_files`): on its own node, while they are still in the page cache, all
ranks at once.

DeepSpeed writes a rank's shards through its checkpoint engine (`engine.checkpoint_engine`, the
extension point behind its Nebula / fast / decoupled writers); `RecordingCheckpointEngine` wraps
the configured one and notes every path it saves. A few files bypass it: global rank 0 copies the
recovery scripts (`zero_to_fp32.py`, ...) next to the tag directory, and under ZeRO-Infinity
(`optimizer_offload: nvme`) every rank copies its optimizer swap files into
`TAG/offloaded_tensors/rankNN/` (`DeepSpeedEngine.save_checkpoint`). Anything else that no rank
claims is sealed by the driver (`rl.checkpoint.CheckpointManager.save`), so no file goes unlisted.
"""
from __future__ import annotations

import os
from pathlib import Path


class RecordingCheckpointEngine:
    """`inner` (a DeepSpeed CheckpointEngine), noting the path of every file it saves."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.saved: list[str] = []

    def save(self, state_dict, path: str):
        out = self.inner.save(state_dict, path)
        self.saved.append(str(path))
        return out

    def take(self) -> list[str]:
        """The paths saved since the last call."""
        out, self.saved = self.saved, []
        return out

    def __getattr__(self, name: str):  # everything else is the configured engine's
        return getattr(self.inner, name)


def rank_files(path: str, tag: str, recorded: list[str], own: list[Path], global_rank: int,
               swap_rank: int) -> list[str]:
    """This rank's files of the checkpoint at `path`/`tag`, relative to `path`: the ones its
    checkpoint engine `recorded`, its `own` (RNG, expert shards), rank 0's recovery scripts and
    its NVMe swap copies (`swap_rank`: DeepSpeed's index for its `offloaded_tensors/rankNN`)."""
    root = Path(path)
    files = {os.path.relpath(p, root) for p in recorded} | {os.path.relpath(p, root) for p in own}
    if global_rank == 0:
        files |= {p.name for p in root.iterdir() if p.is_file()}
    swap = root / tag / "offloaded_tensors" / f"rank{swap_rank:0>2d}"
    if swap.is_dir():
        files |= {os.path.relpath(p, root) for p in swap.rglob("*") if p.is_file()}
    return sorted(files)

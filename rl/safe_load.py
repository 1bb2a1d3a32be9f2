"""Loading the run's checkpoint files with `torch.load(weights_only=True)`.

A pickle runs whatever code its author put in it; a checkpoint is executed on every resume, so
anyone who could write one file of a run directory (a shared scratch filesystem, a copied run)
could run code as the user. `weights_only=True` builds only tensors, containers, numbers and
strings, plus the classes listed here:

- numpy's array reconstruction (the trainer ranks' and the driver's RNG states hold the numpy
  Mersenne-Twister key; batches generated ahead hold routing arrays), the documented way to
  load numpy arrays safely;
- DeepSpeed's optimizer-state bookkeeping (`ZeroStageEnum`, the loss scalers,
  `fragment_address`): data classes with no code run on load. DeepSpeed itself loads with
  `weights_only=False`; `SafeCheckpointEngine` routes its loads through `load` here.

A checkpoint holding anything else (another DeepSpeed version's new class, or a planted object)
is refused with the file and the class; `RL_TRUST_CHECKPOINTS=1` loads it anyway (only for
checkpoints you wrote yourself). Tools outside the resume path (DeepSpeed's zero_to_fp32) keep
their own loaders.
"""
from __future__ import annotations

import functools
import os
import pickle
from pathlib import Path

import torch

TRUST_ENV = "RL_TRUST_CHECKPOINTS"


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file holds an object `weights_only` loading does not allow."""


@functools.cache
def safe_globals() -> list:
    import numpy as np
    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    dtypes: set[type] = {type(np.dtype(t)) for t in (np.bool_, np.uint8, np.uint16, np.uint32,
                                                     np.uint64, np.int8, np.int16, np.int32, np.int64,
                                                     np.float16, np.float32, np.float64)}
    out: list = [_reconstruct, (_reconstruct, "numpy.core.multiarray._reconstruct"),
                 np.ndarray, np.dtype, *sorted(dtypes, key=lambda t: t.__name__)]
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
        out += [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]
    except ImportError:  # the driver's files need no DeepSpeed
        pass
    return out


def load(path: str | Path, map_location=None, mmap: bool = False):
    """`torch.load(path, weights_only=True)` allowing `safe_globals()`; UnsafeCheckpointError
    names the file and what it holds otherwise (unless RL_TRUST_CHECKPOINTS=1). `mmap`: tensors
    are read from the file when used (`rl.export`)."""
    if os.environ.get(TRUST_ENV) == "1":
        return torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
    try:
        with torch.serialization.safe_globals(safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln or "nsupported" in ln]
        what = lines[0] if lines else str(e).splitlines()[0]
        raise UnsafeCheckpointError(
            f"{path}: refusing to load: it holds an object that loading tensors and plain data "
            f"does not allow ({what}); if you wrote this checkpoint yourself, set "
            f"{TRUST_ENV}=1 to load it anyway") from None


class SafeCheckpointEngine:
    """DeepSpeed's checkpoint engine with its `load` replaced by `load` above; everything else
    (saving, commit, decoupled writes) is the wrapped engine's."""

    def __init__(self, inner):
        self.inner = inner

    def load(self, path: str, map_location=None):
        return load(path, map_location=map_location)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

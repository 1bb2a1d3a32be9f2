"""Every rollout sample of a run, in one HDF5 file (`RUN_DIR/trajectories.h5`).

Schema (version 2; version 1 lacked `staleness` and `version_spans`). One row per sample (prompt x sample); every dataset below has shape (N,),
is resizable (maxshape (None,)) and chunked, and row i of each belongs to the same sample. Rows
are appended in step order.

| dataset            | dtype         | meaning                                                      |
| ------------------ | ------------- | ------------------------------------------------------------ |
| `step`             | int64         | RL step whose rollout batch produced the sample              |
| `weight_version`   | int64         | version of the weights that sampled the newest tokens        |
| `staleness`        | int32         | versions between the oldest sampling weights and the policy  |
|                    |               | trained on the sample (0 on-policy; <= max_staleness)        |
| `version_spans`    | vlen int64    | flattened (first response token, weight version) pairs, one  |
|                    |               | per span sampled with one version (a resumed partial rollout |
|                    |               | has two or more)                                             |
| `prompt_index`     | int64         | index of the prompt in the training set                      |
| `sample_index`     | int32         | position of the sample within its prompt's group (0..n-1)    |
| `prompt_ids`       | vlen int32    | prompt token ids                                             |
| `response_ids`     | vlen int32    | response token ids                                           |
| `prompt_length`    | int32         | len(prompt_ids)                                              |
| `response_length`  | int32         | len(response_ids)                                            |
| `rollout_logprobs` | vlen float32  | engine log-prob of each response token (len response_length) |
| `old_logprobs`     | vlen float32  | trainer log-prob of each response token before the update;   |
|                    |               | empty when the trainer did not compute it                    |
| `reward`           | float32       | scalar reward                                                |
| `advantage`        | float32       | GRPO advantage used in the loss                              |
| `finish_reason`    | uint8         | index into the file attribute `finish_reasons`               |

Optional (`logging.save_routing` with `algorithm.routing_replay: r3`): `routing`, vlen
uint8/uint16, each sample's routing (`rl.rollout.routing`) flattened; its attributes `layers` and
`top_k` give the row shape. Rows appended without routing hold an empty array.

Optional (multi-turn runs, `env.path`): `loss_mask`, vlen uint8, per response token 1 where the
model sampled it and 0 for environment (tool-result) tokens; `episode`, a JSON string per row:
`{"turns": [{"start", "end", "tool_calls": [[name, arguments], ...], "observation"}, ...],
"error": null or why the environment failed}` (a model turn is response_ids[start:end], its
observation the text appended after it). Rows appended without them hold an empty mask and "".

File attributes: `schema_version` (int, 2), `finish_reasons` (JSON list: "stop", "length",
"abort", "other"), `created_unix` (float, seconds).

Crash safety: the writer opens the file for each append and closes it afterwards (which flushes),
so a crash loses at most the batch being written (HDF5 has no journal: a crash in the middle of a
write can still damage the file). Resuming at step s calls `truncate(s)`, which removes the rows of
steps > s (written after the checkpoint); HDF5 does not shrink the file on disk.

Both sides open the file without HDF5 file locking: there is one writer per run (the driver), and
a reader (`launch.inspect`) must never block or crash the run. Reading a live run is best-effort.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import h5py
import numpy as np

SCHEMA_VERSION = 2
TRAJECTORY_FILE = "trajectories.h5"
FINISH_REASONS = ("stop", "length", "abort", "other")

_SCALAR_COLUMNS: dict[str, Any] = {
    "step": np.int64, "weight_version": np.int64, "prompt_index": np.int64,
    "sample_index": np.int32, "prompt_length": np.int32, "response_length": np.int32,
    "reward": np.float32, "advantage": np.float32, "finish_reason": np.uint8,
    "staleness": np.int32,
}
_VLEN_COLUMNS: dict[str, Any] = {
    "prompt_ids": np.int32, "response_ids": np.int32,
    "rollout_logprobs": np.float32, "old_logprobs": np.float32, "version_spans": np.int64,
}
_SCALAR_CHUNK, _VLEN_CHUNK = 4096, 512


class TrajectoryFileError(ValueError):
    """The trajectory file is missing, unreadable or of an unsupported schema."""


def _open(path: Path, mode: str) -> h5py.File:
    try:
        return h5py.File(path, mode, locking=False)
    except (OSError, ValueError) as e:
        raise TrajectoryFileError(f"{path}: cannot open as an HDF5 trajectory file ({e})") from None


def _check_schema(f: h5py.File, path: Path) -> None:
    version = f.attrs.get("schema_version")
    if version is None:
        raise TrajectoryFileError(f"{path}: not a trajectory file (no schema_version attribute)")
    if int(version) != SCHEMA_VERSION:
        raise TrajectoryFileError(f"{path}: schema_version {int(version)} is not supported "
                                  f"(this code reads version {SCHEMA_VERSION})")


def _vlen_array(rows: Sequence[Any], dtype: Any) -> np.ndarray:
    out: np.ndarray = np.empty(len(rows), dtype=object)
    for i, row in enumerate(rows):  # element-wise: equal lengths must not turn into a 2-D array
        out[i] = np.asarray(row, dtype=dtype).reshape(-1)
    return out


def _write(ds: h5py.Dataset, values: np.ndarray, start: int) -> None:
    # write_direct, not `ds[a:b] = values`: h5py's slice assignment turns an object array of
    # equal-length rows into a 2-D array and fails to broadcast it into a vlen dataset.
    ds.write_direct(values, dest_sel=np.s_[start:start + len(values)])


def _finish_codes(reasons: Sequence[str | int]) -> np.ndarray:
    codes: np.ndarray = np.empty(len(reasons), dtype=np.uint8)
    for i, reason in enumerate(reasons):
        if isinstance(reason, str):
            if reason not in FINISH_REASONS:
                raise ValueError(f"finish_reason[{i}]: got {reason!r}, expected one of {FINISH_REASONS}")
            codes[i] = FINISH_REASONS.index(reason)
        else:
            if not 0 <= int(reason) < len(FINISH_REASONS):
                raise ValueError(f"finish_reason[{i}]: got {reason!r}, expected a code in "
                                 f"0..{len(FINISH_REASONS) - 1} or one of {FINISH_REASONS}")
            codes[i] = int(reason)
    return codes


def _batch_arrays(step: int, n: int, columns: dict[str, Any]) -> dict[str, np.ndarray]:
    """One array of n rows per dataset (routing aside) from `append`'s checked columns. Raises
    ValueError for a log-prob row whose length is not its response's."""
    data: dict[str, np.ndarray] = {name: _vlen_array(columns[name], dtype)
                                   for name, dtype in _VLEN_COLUMNS.items()}
    response_len = np.array([len(r) for r in data["response_ids"]], dtype=np.int32)
    for name in ("rollout_logprobs", "old_logprobs"):
        for i, lp in enumerate(data[name]):
            if len(lp) != response_len[i] and not (name == "old_logprobs" and len(lp) == 0):
                raise ValueError(f"trajectory batch: {name}[{i}] has {len(lp)} values for a "
                                 f"response of {response_len[i]} tokens")
    data["step"] = np.full(n, step, dtype=np.int64)
    data["prompt_length"] = np.array([len(p) for p in data["prompt_ids"]], dtype=np.int32)
    data["response_length"] = response_len
    data["finish_reason"] = _finish_codes(columns["finish_reason"])
    for name in ("weight_version", "prompt_index", "sample_index", "reward", "advantage",
                 "staleness"):
        data[name] = np.asarray(columns[name], dtype=_SCALAR_COLUMNS[name]).reshape(n)
    return data


_EPISODE_COLUMNS: dict[str, tuple[Any, Any]] = {
    "loss_mask": (h5py.vlen_dtype(np.dtype(np.uint8)), []),
    "episode": (h5py.string_dtype(), ""),
}
"""The multi-turn columns: name -> (dtype, the value of a row without it)."""


def _vlen_or_str(rows: Sequence[Any], name: str) -> np.ndarray:
    if name == "loss_mask":
        return _vlen_array(rows, np.uint8)
    out: np.ndarray = np.empty(len(rows), dtype=object)
    out[:] = list(rows)
    return out


def _episode_arrays(n: int, response_len: np.ndarray, loss_mask, episodes
                    ) -> dict[str, np.ndarray] | None:
    """The multi-turn columns of a batch (None when it has none); ValueError for a mask whose
    length is not its response's."""
    if loss_mask is None and episodes is None:
        return None
    mask = loss_mask if loss_mask is not None else [[]] * n
    eps = episodes if episodes is not None else [None] * n
    if len(mask) != n or len(eps) != n:
        raise ValueError(f"trajectory batch: {len(mask)} loss masks and {len(eps)} episodes "
                         f"for {n} rows")
    for i, m in enumerate(mask):
        if len(m) not in (0, int(response_len[i])):
            raise ValueError(f"trajectory batch: loss_mask[{i}] has {len(m)} values for a "
                             f"response of {response_len[i]} tokens")
    return {"loss_mask": _vlen_or_str(mask, "loss_mask"),
            "episode": _vlen_or_str(["" if e is None else json.dumps(e) for e in eps],
                                    "episode")}


class TrajectoryWriter:
    """Appends rollout batches to `path` (created with the schema on first use)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if self.path.exists():
            with _open(self.path, "r") as f:
                _check_schema(f, self.path)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _open(self.path, "w") as f:
            f.attrs["schema_version"] = SCHEMA_VERSION
            f.attrs["finish_reasons"] = json.dumps(FINISH_REASONS)
            f.attrs["created_unix"] = time.time()
            for name, dtype in _SCALAR_COLUMNS.items():
                f.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype,
                                 chunks=(_SCALAR_CHUNK,))
            for name, dtype in _VLEN_COLUMNS.items():
                f.create_dataset(name, shape=(0,), maxshape=(None,),
                                 dtype=h5py.vlen_dtype(np.dtype(dtype)), chunks=(_VLEN_CHUNK,))

    def append(self, *, step: int, weight_version: int | Sequence[int], prompt_index: Sequence[int],
               prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
               rollout_logprobs: Sequence[Sequence[float]], reward: Sequence[float],
               advantage: Sequence[float], finish_reason: Sequence[str | int],
               old_logprobs: Sequence[Sequence[float]] | None = None,
               sample_index: Sequence[int] | None = None,
               version_spans: Sequence[Sequence[tuple[int, int]]] | None = None,
               staleness: Sequence[int] | None = None,
               routing: Sequence[np.ndarray] | None = None,
               loss_mask: Sequence[Sequence[int]] | None = None,
               episodes: Sequence[dict] | None = None) -> int:
        """Append one batch of n samples (every sequence argument has length n); returns the
        number of rows in the file afterwards.

        `weight_version` is one int for the batch or one per sample. `finish_reason` entries are
        names from FINISH_REASONS or their codes. `sample_index` defaults to the order of each
        prompt_index's occurrences within this batch. `version_spans` defaults to one span per
        sample from its weight_version, `staleness` to 0. Log-prob rows must have the length of their
        response (`old_logprobs` rows may also be empty). Raises ValueError on a malformed batch
        or a step older than the file's last step (resume must `truncate` first).
        """
        n = len(prompt_index)
        if n == 0:
            return self.num_rows()
        if isinstance(weight_version, (int, np.integer)):
            weight_version = [int(weight_version)] * n
        if sample_index is None:
            seen: dict[int, int] = {}
            order: list[int] = []
            for p in prompt_index:
                order.append(seen.get(int(p), 0))
                seen[int(p)] = order[-1] + 1
            sample_index = order
        if old_logprobs is None:
            old_logprobs = [[]] * n
        if version_spans is None:
            version_spans = [[(0, int(v))] for v in weight_version]
        if staleness is None:
            staleness = [0] * n
        flat_spans = [[x for span in spans for x in span] for spans in version_spans]
        columns = {"weight_version": weight_version, "prompt_index": prompt_index,
                   "sample_index": sample_index, "prompt_ids": prompt_ids,
                   "response_ids": response_ids, "rollout_logprobs": rollout_logprobs,
                   "old_logprobs": old_logprobs, "reward": reward, "advantage": advantage,
                   "finish_reason": finish_reason, "version_spans": flat_spans,
                   "staleness": staleness}
        for name, values in columns.items():
            if len(values) != n:
                raise ValueError(f"trajectory batch: {name} has {len(values)} rows, "
                                 f"prompt_index has {n}")
        data = _batch_arrays(step, n, columns)
        extra = _episode_arrays(n, data["response_length"], loss_mask, episodes)
        return self._write_rows(step, n, data, routing, extra)

    def _write_rows(self, step: int, n: int, data: dict[str, np.ndarray],
                    routing: Sequence[np.ndarray] | None,
                    extra: dict[str, np.ndarray] | None = None) -> int:
        """Append `data` (n rows, one array per dataset but routing); returns the row count."""
        with _open(self.path, "a") as f:
            _check_schema(f, self.path)
            start = f["step"].shape[0]
            if start and int(f["step"][start - 1]) > step:
                raise ValueError(f"trajectory batch: step {step} is older than the file's last step "
                                 f"{int(f['step'][start - 1])} (truncate the file when resuming)")
            # The step column is resized last: a row counts only once every column holds it.
            if routing is not None and "routing" not in f:
                ds = f.create_dataset("routing", shape=(start,), maxshape=(None,),
                                      dtype=h5py.vlen_dtype(routing[0].dtype),
                                      chunks=(_VLEN_CHUNK,))
                ds.attrs["layers"], ds.attrs["top_k"] = routing[0].shape[1:]
            if "routing" in f:
                data["routing"] = _vlen_array([[]] * n if routing is None else routing,
                                              f["routing"].dtype.metadata["vlen"])
            optional = ["routing"] if "routing" in f else []
            for name, (dtype, empty) in _EPISODE_COLUMNS.items():
                if extra and name not in f:
                    f.create_dataset(name, shape=(start,), maxshape=(None,), dtype=dtype,
                                     chunks=(_VLEN_CHUNK,))
                    if start:
                        _write(f[name], _vlen_or_str([empty] * start, name), 0)
                if name in f:
                    data[name] = extra[name] if extra else _vlen_or_str([empty] * n, name)
                    optional.append(name)
            for name in [*_VLEN_COLUMNS, *optional,
                         *(c for c in _SCALAR_COLUMNS if c != "step"), "step"]:
                ds = f[name]
                ds.resize((start + n,))
                _write(ds, data[name], start)
            f.flush()
            return start + n

    def num_rows(self) -> int:
        with _open(self.path, "r") as f:
            return int(f["step"].shape[0])

    def truncate(self, step: int) -> int:
        """Remove every row with step > `step`; returns the number of rows removed."""
        with _open(self.path, "a") as f:
            _check_schema(f, self.path)
            steps = f["step"][:]
            keep = steps <= step
            removed = int((~keep).sum())
            if removed == 0:
                return 0
            n_keep = int(keep.sum())
            is_prefix = bool(keep[:n_keep].all())
            optional = [c for c in ("routing", *_EPISODE_COLUMNS) if c in f]
            for name in [*_SCALAR_COLUMNS, *_VLEN_COLUMNS, *optional]:
                ds = f[name]
                if not is_prefix:  # rows out of step order (should not happen): compact them
                    _write(ds, ds[: len(steps)][keep], 0)
                ds.resize((n_keep,))
            f.flush()
            return removed


@dataclass(frozen=True, slots=True)
class StepSummary:
    step: int
    num_rows: int
    reward_mean: float
    reward_std: float
    response_length_mean: float
    truncated_frac: float
    """Fraction of samples with finish reason 'length'."""
    weight_version_min: int
    weight_version_max: int


class TrajectoryReader:
    """Read access to a trajectory file. Scalar columns are loaded once; rows are read on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise TrajectoryFileError(f"{self.path}: no such trajectory file")
        self._file = _open(self.path, "r")
        try:
            _check_schema(self._file, self.path)
            self.finish_reasons: tuple[str, ...] = tuple(json.loads(self._file.attrs["finish_reasons"]))
            self.num_rows = int(self._file["step"].shape[0])
        except Exception:
            self._file.close()
            raise
        self._columns: dict[str, np.ndarray] = {}

    def column(self, name: str) -> np.ndarray:
        """A whole scalar column (see the schema), as a numpy array of length num_rows."""
        if name not in _SCALAR_COLUMNS:
            raise KeyError(f"{name!r} is not a scalar column; expected one of {list(_SCALAR_COLUMNS)}")
        if name not in self._columns:
            self._columns[name] = self._file[name][: self.num_rows]
        return self._columns[name]

    def steps(self) -> list[int]:
        return sorted(int(s) for s in np.unique(self.column("step")))

    def row(self, i: int) -> dict[str, Any]:
        """Every field of row i: ints/floats for scalars, numpy arrays for token ids and log-probs,
        and the finish reason as its name."""
        if not -self.num_rows <= i < self.num_rows:
            raise IndexError(f"row {i} out of range (file has {self.num_rows} rows)")
        i %= self.num_rows
        out: dict[str, Any] = {}
        for name in _SCALAR_COLUMNS:
            value = self._file[name][i]
            out[name] = float(value) if np.issubdtype(value.dtype, np.floating) else int(value)
        for name in _VLEN_COLUMNS:
            out[name] = np.asarray(self._file[name][i])
        out["finish_reason"] = self.finish_reasons[out["finish_reason"]]
        out["version_spans"] = out["version_spans"].reshape(-1, 2)
        if "loss_mask" in self._file:
            out["loss_mask"] = np.asarray(self._file["loss_mask"][i])
        if "episode" in self._file:
            raw = self._file["episode"][i]
            raw = raw.decode() if isinstance(raw, bytes) else raw
            out["episode"] = json.loads(raw) if raw else None
        if "routing" in self._file:
            ds = self._file["routing"]
            out["routing"] = np.asarray(ds[i]).reshape(-1, int(ds.attrs["layers"]),
                                                       int(ds.attrs["top_k"]))
        return out

    def step_summaries(self) -> list[StepSummary]:
        steps, reward = self.column("step"), self.column("reward").astype(np.float64)  # type: ignore[var-annotated]  # lint baseline (issue 39)
        length, version = self.column("response_length"), self.column("weight_version")
        truncated = self.column("finish_reason") == self.finish_reasons.index("length")
        out = []
        for s in self.steps():
            sel = steps == s
            out.append(StepSummary(
                step=s, num_rows=int(sel.sum()), reward_mean=float(reward[sel].mean()),
                reward_std=float(reward[sel].std()), response_length_mean=float(length[sel].mean()),
                truncated_frac=float(truncated[sel].mean()),
                weight_version_min=int(version[sel].min()), weight_version_max=int(version[sel].max())))
        return out

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TrajectoryReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

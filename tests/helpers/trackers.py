"""Reading back what the tracking sinks wrote, offline: W&B's offline run files and MLflow's store.

W&B keeps no Python reader for its `.wandb` transaction log any more (wandb-core writes it), so
`wandb_records` parses it: a 7-byte header (`:W&B`, magic 0xBEE1, version 0), then LevelDB-log
style records in 32 KiB blocks (crc32 of type+data, 2-byte length, type FULL/FIRST/MIDDLE/LAST),
each payload a `wandb.proto.wandb_internal_pb2.Record`. Every record's checksum is verified, so a
wrong parse fails rather than reading garbage.
"""
from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B" and data[4:7] == b"\xe1\xbe\x00", data[:7]
    pos, payload = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the rest of a block too short for a header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:
            break
        chunk = data[pos + HEADER:pos + HEADER + length]
        assert zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF == crc, f"bad record at {pos}"
        pos += HEADER + length
        payload += chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(payload)
            yield record
            payload = b""


@dataclass
class WandbLife:
    """One offline-run directory: one life of a training run."""
    run_id: str
    display_name: str
    tags: list[str]
    config: dict
    rows: list[dict] = field(default_factory=list)
    """Every history row, {key: value} (`step`, `_step`, the tags)."""
    exit_code: int | None = None


def wandb_life(run_dir: Path) -> WandbLife:
    """Read RUN_DIR/wandb/offline-run-*/run-ID.wandb of one offline run directory."""
    (path,) = Path(run_dir).glob("run-*.wandb")
    life = None
    for rec in wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            config = {i.key: json.loads(i.value_json) for i in rec.run.config.update}
            life = WandbLife(rec.run.run_id, rec.run.display_name, list(rec.run.tags), config)
        elif kind == "history":
            assert life is not None
            life.rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                              for i in rec.history.item})
        elif kind == "exit":
            assert life is not None
            life.exit_code = rec.exit.exit_code
    assert life is not None, f"{path} holds no run record"
    return life


def wandb_lives(run_dir: Path) -> list[WandbLife]:
    """Every offline life of a training run (RUN_DIR/wandb/offline-run-*), oldest first."""
    return [wandb_life(d) for d in sorted((Path(run_dir) / "wandb").glob("offline-run-*"))]


def wandb_scalars(lives: list[WandbLife], tag: str) -> list[tuple[int, float]]:
    """(step, value) of `tag` over every life, in the order logged."""
    return [(row["step"], row[tag]) for life in lives for row in life.rows if tag in row]


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] as TensorBoard's reader shows them (resume purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(Path(run_dir) / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def mlflow_client(uri: str):
    import os

    from mlflow.tracking import MlflowClient
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient(tracking_uri=uri)


def mlflow_scalars(client, run_id: str, tag: str) -> list[tuple[int, float]]:
    """(step, value) of `tag` in an MLflow run, by step (then time)."""
    history = client.get_metric_history(run_id, tag)
    return [(m.step, m.value) for m in sorted(history, key=lambda m: (m.step, m.timestamp))]

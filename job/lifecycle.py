"""RUN_DIR/lifecycle.jsonl: one event a line (start / stopped / failure / requeued / done, ...),
appended by `lifecycle` and read back by `read_lifecycle`, the one writer and the one reader."""
from __future__ import annotations

import json
import time
from pathlib import Path

from rl.config import Config


def lifecycle(cfg: Config, event: str, **fields) -> None:
    """Append one event (start / stopped / requeued / done) to RUN_DIR/lifecycle.jsonl."""
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    with open(cfg.run_dir / "lifecycle.jsonl", "a") as f:
        f.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a crash
    return out


def read_lifecycle(run_dir: Path) -> list[dict]:
    """RUN_DIR/lifecycle.jsonl's events in order (`lifecycle` writes them; a line cut by a kill
    is skipped): the one reader of the file."""
    return read_jsonl(run_dir / "lifecycle.jsonl")

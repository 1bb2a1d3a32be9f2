"""What the run's data holds, as hashes: written to RUN_DIR/data_fingerprint.json when a run
starts, compared when it resumes, so data edited in place (same row count, same name) is noticed.

A file's fingerprint is the sha256 of its bytes (a moved file with the same bytes matches: the
paths are not compared, `rl.resume.RESUME_KEYS`); the synthetic task's is the sha256 of its
generated rows (a pure function of the config and the seed, so only a change of the generator's
code moves it).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from rl.config import Config, ConfigError, DataConfig

FILE = "data_fingerprint.json"
_CHUNK = 1 << 20


def _file_entry(path: str) -> dict:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return {"path": path, "bytes": Path(path).stat().st_size, "sha256": digest.hexdigest()}


def data_fingerprint(cfg: DataConfig, seed: int) -> dict:
    """{role: {"path", "bytes", "sha256"} | None} for `source: file` (roles `data.train_path`,
    `data.eval_path`); {"data.synthetic": {"rows", "sha256"}} for the synthetic task. Raises
    OSError when a file cannot be read."""
    if cfg.source == "file":
        return {"data.train_path": _file_entry(cfg.train_path),  # type: ignore[arg-type]  # lint baseline (issue 39)
                "data.eval_path": None if cfg.eval_path is None else _file_entry(cfg.eval_path)}
    from rl.data.synthetic import make_synthetic
    train, evals = make_synthetic(cfg.synthetic, seed)
    rows = [[ex.prompt, ex.answer] for ex in train + evals]
    return {"data.synthetic": {"rows": len(rows), "sha256": hashlib.sha256(
        json.dumps(rows).encode()).hexdigest()}}


def fingerprint_changes(old: dict, new: dict) -> list[str]:
    """One phrase per role whose content differs, naming the file."""
    out = []
    for role in sorted(set(old) | set(new)):
        a, b = old.get(role), new.get(role)
        if (a or {}).get("sha256") == (b or {}).get("sha256"):
            continue
        if a is None or b is None:
            path = (a or b).get("path")  # type: ignore[union-attr]  # lint baseline (issue 39)
            out.append(f"{role} {'added' if a is None else 'removed'}"
                       + (f" ({path})" if path else ""))
        elif "path" in b:
            moved = "" if a["path"] == b["path"] else f", was {a['path']}"
            out.append(f"{role} {b['path']} changed since the run started (sha256 "
                       f"{a['sha256'][:12]} -> {b['sha256'][:12]}, {a['bytes']} -> {b['bytes']} "
                       f"bytes{moved})")
        else:
            out.append(f"{role} generates other rows than when the run started ({a['rows']} -> "
                       f"{b['rows']} rows, sha256 {a['sha256'][:12]} -> {b['sha256'][:12]})")
    return out


def read_fingerprint(run_dir: Path) -> dict | None:
    """The fingerprint the run recorded; None for a run that has none (it started before
    fingerprints were written)."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the data fingerprint ({e}); pass --no-resume "
                          "to start over") from None


def check_fingerprint(cfg: Config, force: bool) -> list[str]:
    """Compare the data with the fingerprint RUN_DIR recorded: ConfigError (one line, naming the
    file) when it changed, unless `force`; returns what changed (empty: the same data, or no
    fingerprint recorded)."""
    old = read_fingerprint(cfg.run_dir)
    if old is None:
        return []
    try:
        new = data_fingerprint(cfg.data, cfg.seed)
    except OSError as e:
        raise ConfigError(f"{e.filename}: cannot read the data to compare it with {FILE} "
                          f"({e.strerror})") from None
    changes = fingerprint_changes(old, new)
    if changes and not force:
        raise ConfigError(f"{cfg.run_dir / FILE}: refusing to resume: {'; '.join(changes)}; "
                          "pass --force to resume with the new data, or --no-resume to start "
                          "over")
    return changes


def write_fingerprint(cfg: Config) -> None:
    from rl.checkpoint import atomic_write_text
    atomic_write_text(cfg.run_dir / FILE,
                      json.dumps(data_fingerprint(cfg.data, cfg.seed), indent=2) + "\n")

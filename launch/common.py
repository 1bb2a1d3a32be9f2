"""Shared command-line plumbing: config loading with one-line errors and exit code 2, and
following a job's output files (`stream_output`, `stream_errors`; used by `launch.submit` and
`slurm.submit`, so neither imports the other's internals)."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import NoReturn

from rl.config import Config, ConfigError, load_config

EXIT_USAGE = 2


class _ConfigParser(argparse.ArgumentParser):
    """Flags may stand anywhere among the files and overrides (`a.yaml --force k=v`): a plain
    parse ends the positional list at the first flag and refuses the words after it."""

    def parse_args(self, args=None, namespace=None):
        return self.parse_intermixed_args(args, namespace)


def config_parser(description: str) -> argparse.ArgumentParser:
    p = _ConfigParser(description=description)
    p.add_argument("config", nargs="+", metavar="CONFIG [CONFIG ...] [key=value ...]",
                   help="one or more YAML config files (later files win), then dotted overrides "
                        "such as trainer.lr=1e-6 (they win over every file)")
    return p


def split_config_args(args: argparse.Namespace) -> argparse.Namespace:
    """Split the positional words into `config_files` (no '=') and `overrides` (with '='),
    keeping `config` as the files joined by spaces for messages. Files must come first."""
    words = list(args.config)
    files = [w for w in words if "=" not in w]
    overrides = [w for w in words if "=" in w]
    if not files:
        fail("config error: <command line>: expected a YAML config file before the overrides")
    if words[:len(files)] != files:
        late = next(w for w in words[len(files):] if "=" not in w)
        fail(f"config error: <command line>:{late}: a config file after an override; put every "
             "file before the key=value overrides")
    args.config_files, args.overrides, args.config = files, overrides, " ".join(files)
    return args


def load_or_exit(paths: str | list[str], overrides: list[str]) -> Config:
    try:
        return load_config(paths, overrides)
    except ConfigError as e:
        fail(f"config error: {e}")


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    print(message.splitlines()[0] if message else "error", file=sys.stderr, flush=True)
    raise SystemExit(code)


def quiet_libraries() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("transformers", "deepspeed", "DeepSpeed", "vllm", "ray", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)


# ---- following a job: what its output files gained, copied to the console --------------------
# Tracebacks the launchers report as one line themselves (or that are no error at all).
_ONE_LINE_EXCEPTIONS = ("ConfigError", "Requeue")
_JOB_FAILED = "Submitted job triggered an exception"  # submitit's, before the traceback


def stream_errors(path: Path, pos: int) -> int:
    """The errors in what the job's stderr gained since `pos`, printed to stderr: whole
    tracebacks (except those of _ONE_LINE_EXCEPTIONS) and other ERROR / `...Error:` lines.

    Returns the position to read from next: the end of the last complete line, or the start of
    a traceback whose exception line has not arrived yet (it is judged once complete).
    """
    if not path.exists():
        return pos
    with open(path, "rb") as f:
        f.seek(pos)
        chunk = f.read()
    done = offset = 0  # bytes judged; bytes read
    block = None  # the open traceback's lines
    for raw in chunk.split(b"\n")[:-1]:  # whole lines only (a progress bar's \r stays inside)
        offset += len(raw) + 1
        line = raw.decode(errors="replace").rstrip("\r")
        if block is not None:
            block.append(line)
            if not line or line[0].isspace():
                continue
            if not line.split(":", 1)[0].endswith(_ONE_LINE_EXCEPTIONS):
                print("\n".join(block), file=sys.stderr, flush=True)
            block = None
        elif line.startswith("Traceback"):
            block = [line]
            continue
        elif (line.startswith("ERROR") or "Error:" in line) and _JOB_FAILED not in line:
            print(line, file=sys.stderr, flush=True)
        done = offset
    return pos + done


def stream_output(path: Path, pos: int, quiet: bool = False, out=None) -> int:
    """Copies what `path` gained since `pos` to `out` (stdout); returns the new position.
    `quiet` drops submitit's own lines (job started, pickle loaded, job completed or failed)."""
    out = out or sys.stdout
    if path.exists():
        with open(path, "rb") as f:
            f.seek(pos)
            chunk = f.read()
        if quiet:  # only whole lines, so that a line cut by the read is judged once complete
            chunk = chunk[:chunk.rfind(b"\n") + 1]
        if chunk:
            text = chunk.decode(errors="replace")
            if quiet:  # run_local reports the outcome itself
                text = "".join(ln for ln in text.splitlines(keepends=True)
                               if not (ln.startswith("submitit INFO") or _JOB_FAILED in ln))
            out.write(text)
            out.flush()
            pos += len(chunk)
    return pos

"""Shared command-line plumbing: config loading with one-line errors and exit code 2."""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from job.failures import EXIT_USAGE
from rl.config import Config, ConfigError, load_config


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

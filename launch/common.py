"""Shared command-line plumbing: config loading with one-line errors and exit code 2."""
from __future__ import annotations

import argparse
import logging
import sys

from rl.config import Config, ConfigError, load_config

EXIT_USAGE = 2


def config_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("config", help="YAML config file (e.g. configs/local.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-6")
    return p


def load_or_exit(path: str, overrides: list[str]) -> Config:
    try:
        return load_config(path, overrides)
    except ConfigError as e:
        fail(f"config error: {e}")


def fail(message: str, code: int = EXIT_USAGE):
    print(message.splitlines()[0] if message else "error", file=sys.stderr, flush=True)
    raise SystemExit(code)


def quiet_libraries() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("transformers", "deepspeed", "DeepSpeed", "vllm", "ray", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)

"""`python -m launch.sft CONFIG [key=value ...]`: build (or reuse) the SFT warm start and print
its greedy accuracy on the eval split."""
from __future__ import annotations

import json
import sys

from launch.common import config_parser, fail, load_or_exit, split_config_args
from rl.config import ConfigError
from rl.console import quiet_libraries


def main(argv: list[str] | None = None) -> int:
    args = split_config_args(config_parser(__doc__).parse_args(argv))
    cfg = load_or_exit(args.config_files, args.overrides)
    quiet_libraries()
    from rl.sft import run_sft, sft_dir
    out = sft_dir(cfg)
    try:
        if (out / "sft.json").is_file():
            accuracy = json.loads((out / "sft.json").read_text())["eval_accuracy"]
            print(f"reusing cached SFT warm start {out}")
        else:
            out, accuracy = run_sft(cfg)
    except ConfigError as e:
        fail(f"config error: {e}")
    print(f"warm-start greedy accuracy on the eval split: {accuracy:.3f} ({out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

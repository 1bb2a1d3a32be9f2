"""Export a run's trained actor: `python -m launch.export RUN_DIR [--step N] --format hf --out DIR`.

Reads the newest intact checkpoint of RUN_DIR (or step N's: sizes and, unless --no-verify, the
SHA-256 of every file checked against its manifest; nothing in the run is changed) and writes the
actor as a Hugging Face model directory: BF16 safetensors (sharded above --max-shard-gb, with
model.safetensors.index.json), config.json, tokenizer and generation config (copied from the model
directory the run started from, or --model-dir), loadable by transformers and vLLM. One line per
shard written. Runs on the CPU, offline; peak memory is about one shard plus one tensor
(rl/export.py, docs/export.md). Leaves out: the `deepseek-v4` published layout (FP8/FP4, issue
41), uploading.

Exit status: 0 on success, 2 on bad input (one line: no such run directory, no intact
checkpoint, unknown --step, --out not empty without --force, ...).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from launch.common import fail


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="the run directory (holds checkpoints/)")
    p.add_argument("--step", type=int, help="export this step's checkpoint (default: the newest "
                                            "intact one)")
    p.add_argument("--format", choices=("hf", "deepseek-v4"), default="hf",
                   help="hf: a Hugging Face model directory in BF16 (default); deepseek-v4: "
                        "the published FP8/FP4 layout (not implemented yet)")
    p.add_argument("--out", type=Path, required=True, help="output directory (missing or empty)")
    p.add_argument("--force", action="store_true", help="replace what --out holds")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="dtype of the floating tensors (the architecture's fp32 modules stay "
                        "fp32); default bfloat16")
    p.add_argument("--max-shard-gb", type=float, default=5.0,
                   help="largest output shard [GiB]; default 5")
    p.add_argument("--model-dir", type=Path,
                   help="where config.json and the tokenizer come from (default: the model "
                        "directory the run started from, found from RUN_DIR/config.yaml)")
    p.add_argument("--no-verify", action="store_true",
                   help="check the checkpoint's file sizes only, not their SHA-256")
    args = p.parse_args(argv)
    if args.format == "deepseek-v4":
        fail("launch.export: --format deepseek-v4 (the published FP8/FP4 layout) is not "
             "implemented yet (issue 41); use --format hf")
    if args.max_shard_gb <= 0:
        fail(f"launch.export: --max-shard-gb {args.max_shard_gb}, expected a value > 0")

    import logging

    from rl.export import (DTYPES, ExportError, export_hf, find_checkpoint, prepare_out,
                           run_model_dir)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        checkpoint, manifest = find_checkpoint(args.run_dir, args.step, not args.no_verify)
        model_dir = args.model_dir or run_model_dir(args.run_dir)
        if model_dir is None or not (Path(model_dir) / "config.json").is_file():
            raise ExportError(f"{args.run_dir}: the model directory the run started from (its "
                              "config and tokenizer) was not found; pass --model-dir DIR")
        prepare_out(args.out, args.force)
        print(f"export: {checkpoint} (step {manifest.get('step')}) -> {args.out}", flush=True)
        record = export_hf(checkpoint, Path(model_dir), args.out, DTYPES[args.dtype],
                           int(args.max_shard_gb * 2**30),
                           say=lambda line: print(line, flush=True))
    except ExportError as e:
        fail(f"export error: {e}")
    print(f"export: done in {record['seconds']:.1f}s: {len(record['shards'])} shard(s), "
          f"{record['bytes'] / 2**30:.2f} GiB, {record['dtype']}, in {args.out}", flush=True)


if __name__ == "__main__":
    main()

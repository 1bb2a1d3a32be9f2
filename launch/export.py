"""Export a run's trained actor: `python -m launch.export RUN_DIR [--step N] --format hf|deepseek-v4 --out DIR`.

Reads the newest intact checkpoint of RUN_DIR (or step N's: sizes and, unless --no-verify, the
SHA-256 of every file checked against its manifest; nothing in the run is changed) and writes the
actor in one of two formats:
  * hf: a Hugging Face model directory: BF16 safetensors (sharded above --max-shard-gb, with
    model.safetensors.index.json), config.json, tokenizer and generation config (copied from the
    model directory the run started from, or --model-dir), loadable by transformers and vLLM;
  * deepseek-v4 (DeepSeek-V4 runs): the layout DeepSeek publishes, which launch.convert reads:
    block-FP8 linears with ue8m0 scales, routed experts in FP4 (--experts fp8: block FP8),
    DeepSeek's names, dtypes and shapes, the published config and tokenizer files, and the
    published MTP layer copied through (--no-mtp leaves it out). The published checkpoint is
    the one launch.convert recorded in the model directory, or --published DIR.
One line per shard written. Runs on the CPU, offline; peak memory is about one shard plus one
tensor (rl/export.py, rl/export_deepseek.py, docs/export.md). Leaves out: uploading, and
training the MTP layer.

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
                        "DeepSeek's published FP8/FP4 layout (DeepSeek-V4 runs)")
    p.add_argument("--out", type=Path, required=True, help="output directory (missing or empty)")
    p.add_argument("--force", action="store_true", help="replace what --out holds")
    p.add_argument("--dtype", choices=("bfloat16", "float32"),
                   help="hf: dtype of the floating tensors (the architecture's fp32 modules stay "
                        "fp32); default bfloat16")
    p.add_argument("--experts", choices=("fp4", "fp8"),
                   help="deepseek-v4: routed experts in FP4 (ue8m0 scales per 32 inputs) or "
                        "block FP8 (fp32 power-of-two scales); default: the published "
                        "checkpoint's form, else fp4")
    p.add_argument("--published", type=Path,
                   help="deepseek-v4: the published checkpoint the run's model was converted "
                        "from (layout, config, tokenizer, MTP layer); default: the one "
                        "launch.convert recorded in the model directory")
    p.add_argument("--no-mtp", action="store_true",
                   help="deepseek-v4: leave the published MTP layer out")
    p.add_argument("--max-shard-gb", type=float, default=5.0,
                   help="largest output shard [GiB]; default 5")
    p.add_argument("--model-dir", type=Path,
                   help="where config.json and the tokenizer come from (default: the model "
                        "directory the run started from, found from RUN_DIR/config.yaml)")
    p.add_argument("--no-verify", action="store_true",
                   help="check the checkpoint's file sizes only, not their SHA-256")
    args = p.parse_args(argv)
    _check_options(args)

    import logging
    import os
    # The export reads DeepSpeed's files on the host and runs nothing on an accelerator; naming
    # the CPU keeps DeepSpeed's import from warning that it found none.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    from rl.export import ExportError, find_checkpoint, prepare_out, run_model_dir
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        checkpoint, manifest = find_checkpoint(args.run_dir, args.step, not args.no_verify)
        model_dir = args.model_dir or run_model_dir(args.run_dir)
        if model_dir is None or not (Path(model_dir) / "config.json").is_file():
            raise ExportError(f"{args.run_dir}: the model directory the run started from (its "
                              "config and tokenizer) was not found; pass --model-dir DIR")
        prepare_out(args.out, args.force)
        print(f"export: {checkpoint} (step {manifest.get('step')}) -> {args.out}", flush=True)
        record = _export(args, checkpoint, Path(model_dir))
    except ExportError as e:
        fail(f"export error: {e}")
    what = record.get("dtype") or f"{record['format']}, experts {record['experts']}"
    print(f"export: done in {record['seconds']:.1f}s: {len(record['shards'])} shard(s), "
          f"{record['bytes'] / 2**30:.2f} GiB, {what}, in {args.out}", flush=True)


def _check_options(args: argparse.Namespace) -> None:
    if args.max_shard_gb <= 0:
        fail(f"launch.export: --max-shard-gb {args.max_shard_gb}, expected a value > 0")
    if args.format == "deepseek-v4" and args.dtype is not None:
        fail("launch.export: --dtype is for --format hf; deepseek-v4 writes each tensor in the "
             "published checkpoint's dtype")
    if args.format == "hf":
        given = [o for o, v in (("--experts", args.experts), ("--published", args.published),
                                ("--no-mtp", args.no_mtp)) if v]
        if given:
            fail(f"launch.export: {', '.join(given)} is for --format deepseek-v4")


def _export(args: argparse.Namespace, checkpoint: Path, model_dir: Path) -> dict:
    def say(line: str) -> None:
        print(line, flush=True)
    shard_bytes = int(args.max_shard_gb * 2**30)
    if args.format == "deepseek-v4":
        from rl.export_deepseek import export_deepseek_v4
        return export_deepseek_v4(checkpoint, model_dir, args.out, args.experts, args.published,
                                  not args.no_mtp, shard_bytes, say)
    from rl.export import DTYPES, export_hf
    return export_hf(checkpoint, model_dir, args.out, DTYPES[args.dtype or "bfloat16"],
                     shard_bytes, say)


if __name__ == "__main__":
    main()

"""Convert the published DeepSeek-V4 checkpoint into what each group loads.

    python -m launch.convert SRC --trainer-out DIR [--rollout-out DIR]
        [--rollout-experts fp8|fp4] [--max-shard-gb 5]

SRC is the published checkpoint directory (sharded safetensors, model.safetensors.index.json,
block-FP8 linears with ue8m0 `.scale`s, FP4 experts). `--trainer-out` gets BF16 (what
`load_model` and DeepSpeed train); `--rollout-out` gets the FP8 layout vLLM's V4 model loads:
with `--rollout-experts fp8` (the default, what the weight sync needs) the FP4 experts are
requantised, losslessly, to the block-FP8 layout the sync sends (`expert_dtype: fp8`); with
`fp4` the published tensors are copied unchanged (MXFP4 experts: no weight sync into it). The
MTP layer (`mtp.*`) is kept only by that unchanged copy: the trainer does not train it and no
weight sync updates it. One line per input shard.
Rerunning the same command resumes an interrupted conversion and re-verifies every finished
shard's sha256 (a corrupt one is converted again). Leaves out: BF16 -> FP8 requantisation of a
trained checkpoint, and tensor-parallel resharding (vLLM shards at load time).

Exit status: 0 on success, 2 on bad input (one line naming the file and tensor).
"""
from __future__ import annotations

import argparse

from launch.common import fail
from rl.models.convert import ROLLOUT_EXPERTS, ConvertError, convert, open_source


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", help="the published DeepSeek-V4 checkpoint directory")
    p.add_argument("--trainer-out", help="BF16 output directory (model.path of the trainer)")
    p.add_argument("--rollout-out", help="FP8 output directory (rollout.model_path of vLLM)")
    p.add_argument("--rollout-experts", choices=ROLLOUT_EXPERTS, default="fp8",
                   help="routed experts of --rollout-out: fp8 (block FP8, what the weight sync "
                        "loads; default) or fp4 (the published MXFP4, copied)")
    p.add_argument("--max-shard-gb", type=float, default=5.0,
                   help="largest output shard [GiB] (peak memory is about this plus one input "
                        "shard); default 5")
    args = p.parse_args(argv)
    if not (args.trainer_out or args.rollout_out):
        fail("launch.convert: give --trainer-out DIR and/or --rollout-out DIR")
    if args.max_shard_gb <= 0:
        fail(f"launch.convert: --max-shard-gb {args.max_shard_gb}, expected a value > 0")
    try:
        src = open_source(args.source)
        for target, out in (("trainer", args.trainer_out), ("rollout", args.rollout_out)):
            if out:
                convert(src, out, target, rollout_experts=args.rollout_experts,
                        max_shard_bytes=int(args.max_shard_gb * 2**30))
    except ConvertError as e:
        fail(f"convert error: {e}")


if __name__ == "__main__":
    main()

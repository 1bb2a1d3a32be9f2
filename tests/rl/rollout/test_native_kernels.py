"""Triton decode kernels = torch references, under the Triton interpreter on CPU (~11 s); the
split-K decode attention's split count."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_triton_kernels_match_torch_references_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "tests.rl.rollout.kernel_cases"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
    assert "decode attention block_l=16" in proc.stdout and "grouped fp8" in proc.stdout
    assert "fp8 kv decode attention block_l=16" in proc.stdout
    assert "split decode attention splits=5" in proc.stdout and "fp8 kv split 4" in proc.stdout
    for mma in ("(True, True)", "(False, False)"):
        assert f"long split None fp8 kv mma {mma} vs single" in proc.stdout
    assert "fp8_mma=(True, False)" in proc.stdout
    for case in ("act quant values K=200", "rmsnorm+quant scales", "silu_mul+quant scales",
                 "sample half-precision logits = their fp32 copy", "w8a8 triton 40x1024x256",
                 "w8a8 triton refuses a misaligned weight", "sample T=1.3 chunks=2",
                 "attention+quant fp8 splits=1 scales", "attention+quant bf16 splits=1 scales"):
        assert case in proc.stdout, case


def test_decode_splits_fill_the_gpu_only_when_rows_x_heads_do_not():
    from rl.rollout.native.kernels import MAX_SPLITS, decode_splits

    # Qwen3-0.6B: 8 kv heads. 256 rows = 2,048 programs, >= 2 waves of 132 SMs x 2: one pass.
    assert decode_splits(256, 8, 1152) == 1
    assert decode_splits(1024, 8, 1152) == 1
    # 64 rows = 512 programs < 528: two splits reach 1,024 (~3 waves of 264).
    assert decode_splits(64, 8, 1152) == 2
    assert decode_splits(16, 8, 4096) == 7        # ceil(792 / 128)
    assert decode_splits(1, 8, 1 << 16) == MAX_SPLITS
    # Short contexts cap it: at least 2 blocks of 64 per split.
    assert decode_splits(1, 8, 256) == 2
    assert decode_splits(1, 8, 100) == 1          # 2 blocks: one split
    assert decode_splits(1, 8, 100, block_l=16) == 3
    # More SMs, more splits; the count never drops as the context grows.
    assert decode_splits(64, 8, 1152, sms=264) == 4
    counts = [decode_splits(8, 4, c) for c in range(1, 5000, 97)]
    assert counts == sorted(counts) and counts[0] == 1 and counts[-1] == MAX_SPLITS


def test_w8a8_auto_takes_our_kernel_at_decode_rows():
    """The FP8 engine's "auto" GEMM choice (bench/results/fp8_gemm.md, H200): ours for every
    shape up to 64 rows; up to 256 rows for narrow outputs (N <= K: o / down at decode) whose
    split-K partials the next RMSNorm sums, but only while the launch splits K; cuBLAS's beyond
    (prefill) and for wide outputs (qkv, gate_up) past 64 rows. Splits: about 2 programs per SM,
    >= 2 K blocks each, partials within twice the weight's bytes; wide outputs unsplit."""
    from rl.rollout.native.kernels import w8a8_triton_splits
    from rl.rollout.native.model import w8a8_kernel

    o, down, qkv, big = (1024, 2048), (1024, 3072), (4096, 1024), (4096, 8192)  # (N, K)
    qkv4, gate_up4, o4, down4 = (6144, 2560), (19456, 2560), (2560, 4096), (2560, 9728)
    # Qwen3-0.6B o: 8 output tiles of 64 x 128: 8 splits (2 K blocks each) at 64 rows; at 256,
    # 32 tiles and 4 splits (partials 256 x 1024 x 4 x 4 = twice the 2 MB weight).
    assert [w8a8_triton_splits(r, *o) for r in (64, 256)] == [8, 4]
    assert [w8a8_triton_splits(r, *down4) for r in (64, 128, 256)] == [13, 6, 3]
    assert w8a8_triton_splits(256, *big) == 2          # 128 tiles: 2 programs per SM
    assert w8a8_triton_splits(64, *qkv4) == w8a8_triton_splits(16, *gate_up4) == 1   # wide
    for rows in (1, 16, 64):
        for shape in (o, down, qkv, big, qkv4, gate_up4, o4, down4):
            assert w8a8_kernel(rows, *shape, partial=False) == "triton", (rows, shape)
    for rows in (128, 256):
        for shape in (down, o4, down4, big):
            assert w8a8_kernel(rows, *shape, partial=True) == "triton", (rows, shape)
            assert w8a8_kernel(rows, *shape, partial=False) == "cublas"  # would sum them itself
        for shape in (qkv, qkv4, gate_up4):
            assert w8a8_kernel(rows, *shape, partial=True) == "cublas", (rows, shape)
    assert w8a8_kernel(512, *down, partial=True) == "cublas"        # prefill-sized
    # a narrow output whose output tiles fill 2 per SM unsplit: nothing for the RMSNorm to sum
    assert w8a8_triton_splits(256, 16384, 16384) == 1
    assert w8a8_kernel(256, 16384, 16384, partial=True) == "cublas"

"""Shared bits of the benchmarks: device facts, measured ceilings, model shapes, result files.

Every benchmark writes `<name>.json` (all numbers, the device, the date, the command) and
`<name>.md` (a table) into `--out` (default `bench/results/`). `--smoke` runs a reduced CPU
version (tiny shapes, few steps) that only proves the script works.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"

# Qwen3-0.6B / Qwen3-1.7B shapes (their public config.json) and a small Qwen3-MoE (the
# MoE shape NOTES.md's HF baseline used: 64 experts, top-8, 768-wide experts).
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=3072, tie_word_embeddings=True, rope_theta=1e6,
                 max_position_embeddings=40960, rms_norm_eps=1e-6)
QWEN3_17B = dict(QWEN3_06B, hidden_size=2048, intermediate_size=6144)
QWEN3_4B = dict(QWEN3_06B, hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                intermediate_size=9728)
QWEN3_MOE_SMALL = dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=8,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                       intermediate_size=3072, num_experts=64, num_experts_per_tok=8,
                       moe_intermediate_size=768, norm_topk_prob=True,
                       tie_word_embeddings=False, rope_theta=1e6,
                       max_position_embeddings=40960, rms_norm_eps=1e-6)
TINY = dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, intermediate_size=256,
            tie_word_embeddings=False, max_position_embeddings=512)
TINY_MOE = dict(TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)


def hf_config(model_type: str, fields: dict):
    from transformers import AutoConfig
    fields = dict(fields)
    theta = fields.pop("rope_theta", None)
    config = AutoConfig.for_model(model_type, bos_token_id=None, eos_token_id=None,
                                  pad_token_id=0, **fields)
    if theta is not None:  # transformers 5 keeps rope settings in rope_parameters
        config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    return config


def random_model(model_type: str, fields: dict, device: str, dtype: torch.dtype):
    """An HF model with its own random init, built directly on `device`."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config(model_type, fields), dtype=dtype)
    return model.eval()


def load_run_config(path: str, overrides: list[str]):
    """The run config of a benchmark that runs the RL loop, as `launch.submit` would check it:
    the placement refused at once (exit 2, not after the warm start), and the local Ray started
    when the loop will use Ray."""
    from launch.checks import check_placement_or_exit
    from rl.cluster.placement import choose_placement
    from rl.config import load_config
    cfg = load_config(path, overrides)
    check_placement_or_exit(cfg)
    if choose_placement(cfg).backend == "ray":  # the loop's own choice: Ray when it is installed
        from job.run import start_local_ray
        start_local_ray(cfg)
    return cfg


def parse_args(description: str, extra=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run (tests use it)")
    parser.add_argument("--out", default=str(RESULTS), help="directory for the json + md")
    if extra:
        extra(parser)
    return parser.parse_args()


def attention_choices(text: str) -> list[tuple[str, int | None]]:
    """`--attention` of the rollout benchmarks: comma list of rollout.decode_attention modes or
    fixed split counts -> [(mode, fixed splits or None)]; anything else exits 2 naming it."""
    out = []
    for choice in text.split(","):
        if choice in ("auto", "single", "split"):
            out.append((choice, None))
        elif choice.isdigit() and int(choice) > 0:
            out.append(("single", int(choice)))
        else:
            print(f"--attention: {choice!r} is not auto, single, split or a count > 0",
                  file=sys.stderr)
            raise SystemExit(2)
    return out


def _module_name(script: str) -> str:
    """`bench.x` for this checkout's bench/x.py, wherever the checkout is."""
    path = Path(script).resolve().with_suffix("")
    root = Path(__file__).resolve().parents[1]
    rel = path.relative_to(root) if path.is_relative_to(root) else Path(path.name)
    return rel.as_posix().replace("/", ".")


def device_info() -> dict:
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__, "python": platform.python_version(),
            "command": "python -m " + _module_name(sys.argv[0]) + " " + " ".join(sys.argv[1:])}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["num_gpus"] = torch.cuda.device_count()
    else:
        info["device"] = f"CPU ({platform.processor() or platform.machine()})"
        info["num_gpus"] = 0
    return info


def sync(device: torch.device | str | None = None) -> None:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize(device)


def measure_copy_bandwidth(device: str = "cuda", gbytes: float = 2.0) -> float:
    """Device-to-device copy, bytes read + written per second (GB/s), best of 10."""
    n = int(gbytes * 1e9 / 2)
    a = torch.empty(n, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    best = float("inf")
    for i in range(13):
        sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        sync(device)
        if i >= 3:
            best = min(best, time.perf_counter() - t0)
    return 2 * a.numel() * 2 / best / 1e9


def measure_bf16_peak(device: str = "cuda", n: int = 8192) -> float:
    """bf16 matmul n^3 on random data, TFLOP/s (mean of 10 after 3 warm-ups)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return 2 * n ** 3 * 10 / (time.perf_counter() - t0) / 1e12


def write_results(name: str, out: str, info: dict, rows: list[dict], columns: list[str],
                  notes: list[str], quiet: bool = False) -> Path:
    """`<out>/<name>.json` and `<out>/<name>.md`; returns the markdown path."""
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps({**info, "rows": rows, "notes": notes},
                                                     indent=2) + "\n")

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return "" if v is None else str(v)
    lines = [f"# {name}", "", f"Device: {info['device']} (x{info.get('num_gpus', 0)}), "
             f"{info['date']}, torch {info['torch']}", "", f"Command: `{info['command']}`", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    lines += [""] + [f"- {n}" for n in notes] + [""]
    path = out_dir / f"{name}.md"
    path.write_text("\n".join(lines))
    if not quiet:
        print("\n".join(lines))
    return path

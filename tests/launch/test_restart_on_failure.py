"""End to end on this machine: a trainer rank killed in the middle of step 3 (its peer then
hangs in a collective with it) makes the run fail; the local launcher restarts the job by
itself, the job resumes from the checkpoint of step 2, and the run ends with the same step
metrics as an uninterrupted run of the same config."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # three starts of a 2-rank job

ROOT = Path(__file__).resolve().parents[2]
TINY = ["num_steps=4", "algorithm.prompts_per_step=8", "rollout.n_samples=2", "eval.every=0",
        "checkpoint.every=2", "model.warm_start=false", "rollout.engine=hf",
        "trainer.warmup_steps=1", "cluster.max_requeues=2"]
COMPARED = ("reward/mean", "reward/std", "train/loss", "train/kl", "train/grad_norm",
            "train/entropy", "rollout/response_length")


def submit(tmp: Path, name: str, env: dict | None = None) -> tuple[int, str]:
    e = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT), **(env or {})}
    out = subprocess.run([sys.executable, "-m", "launch.submit", str(ROOT / "configs" / "local.yaml"),
                          *TINY, f"output_dir={tmp}", f"name={name}"],
                         cwd=ROOT, env=e, capture_output=True, text=True, timeout=1500)
    return out.returncode, out.stdout + out.stderr


def steps(run_dir: Path) -> list[dict]:
    return [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "train/loss" in m]


def test_a_killed_trainer_rank_restarts_the_job_and_the_run_matches(tmp_path):
    rc, out = submit(tmp_path, "crashed", {"RL_FAULT_KILL_TRAINER": "3"})
    assert rc == 0, out[-3000:]
    assert ("step 3 failed (ActorDied: " in out
            and "restarting from the checkpoint at step 2 (restart 1 of at most 2)" in out), out
    events = [json.loads(line)["event"]
              for line in (tmp_path / "crashed" / "lifecycle.jsonl").read_text().splitlines()]
    assert events == ["start", "failure", "restarting", "start", "done"]
    rc, out = submit(tmp_path, "reference")
    assert rc == 0, out[-3000:]
    got, want = steps(tmp_path / "crashed"), steps(tmp_path / "reference")
    assert [m["step"] for m in got] == [m["step"] for m in want] == [1, 2, 3, 4]
    for g, w in zip(got, want):
        for key in (k for k in COMPARED if k in w):  # train/kl only with algorithm.kl_coef
            assert g[key] == w[key], (g["step"], key, g[key], w[key])

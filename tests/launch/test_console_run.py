"""What a user sees of `python -m launch.submit configs/local.yaml`: step lines, the warm start,
progress, the summary and errors on the console; vLLM, Ray and DeepSpeed in RUN_DIR/logs/job.log.

One tiny real run per mode (shared by the assertions): quiet with the vLLM engine (the default
and the main noise source), verbose with the HF engine, and one whose reward plugin fails.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]  # the first test starts two runs

ROOT = Path(__file__).resolve().parents[2]
TINY = ["num_steps=2", "algorithm.prompts_per_step=8", "rollout.n_samples=2", "eval.every=0",
        "eval.num_prompts=8", "eval.pass_k=1", "checkpoint.every=0"]
STEP = re.compile(r"^step +\d+/2 \| ")


def _submit(tmp: Path, name: str, *extra: str) -> tuple[int, list[str]]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "launch.submit", str(ROOT / "configs" / "local.yaml"),
                          *TINY, f"output_dir={tmp}", f"name={name}", *extra],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    return out.returncode, out.stdout.splitlines() + out.stderr.splitlines()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("console")
    # A 20-step SFT warm start of its own (seconds), so that the warm-start lines show.
    quiet = _submit(tmp, "quiet", "sft.steps=20", f"sft.cache_dir={tmp / 'sft'}")
    verbose = _submit(tmp, "verbose", "logging.verbose=true", "model.warm_start=false",
                      "rollout.engine=hf")
    return tmp, quiet, verbose


def test_quiet_console_shows_steps_warm_start_and_summary_only(runs):
    tmp, (rc, lines), _ = runs
    assert rc == 0, "\n".join(lines[-30:])
    steps = [ln for ln in lines if STEP.match(ln)]
    other = [ln for ln in lines if not STEP.match(ln) and ln.strip()]
    assert len(steps) == 2, lines
    assert len(other) <= 25, "\n".join(other)
    assert not [ln for ln in other if "pid=" in ln or re.search(r"\b(INFO|WARNING) \d\d-\d\d ", ln)]
    assert any(ln.startswith("SFT warm start: training 20 steps") for ln in other)
    assert any(ln.startswith("SFT done in") for ln in other)
    assert any(ln.startswith("INFO rl.runtime: runtime ready in") for ln in other)  # progress
    assert "run quiet: done at step 2/2" in other
    log = tmp / "quiet" / "logs" / "job.log"
    assert any(str(log.resolve()) in ln for ln in other)  # where the library output went


def test_quiet_run_keeps_the_library_output_in_the_job_log(runs):
    tmp, _, _ = runs
    text = (tmp / "quiet" / "logs" / "job.log").read_text()
    assert "step    2/2 | reward" in text  # the console's lines too, for context
    assert "Initializing a V1 LLM engine" in text  # vLLM
    assert "(TrainerWorker pid=" in text and "(EngineHost pid=" in text  # Ray's worker output
    assert "real_accelerator.py" in text  # DeepSpeed


def test_verbose_console_shows_the_library_output(runs):
    tmp, (_, quiet), (rc, lines) = runs
    assert rc == 0, "\n".join(lines[-30:])
    other = [ln for ln in lines if not STEP.match(ln) and ln.strip()]
    assert len([ln for ln in lines if STEP.match(ln)]) == 2
    assert any("(TrainerWorker pid=" in ln for ln in other)
    assert any("real_accelerator.py" in ln for ln in other)
    assert len(other) > len([ln for ln in quiet if not STEP.match(ln) and ln.strip()])
    assert not (tmp / "verbose" / "logs").exists()


def test_error_in_the_job_reaches_the_quiet_console(tmp_path):
    rc, lines = _submit(tmp_path, "broken", "model.warm_start=false", "rollout.engine=hf",
                        "reward.function=tests.launch.broken_reward:score")
    assert rc != 0
    assert lines[-1].startswith("config error: reward.function: got "), lines
    assert "reward plugin broken on purpose" in lines[-1]
    assert len(lines) <= 25, "\n".join(lines)

"""`launch.submit CONFIG --dry-run`: the sbatch script, the plan and the checks it could not run,
with nothing submitted and no run directory made. A fake `sbatch` on PATH records any call."""
import json
from pathlib import Path

import pytest

from launch.submit import main as submit_main
from rl.config import load_config
from slurm.sbatch import make_executor

ROOT = Path(__file__).resolve().parents[2]
V4 = str(ROOT / "configs" / "deepseek_v4_flash_3node.yaml")
LOCAL = str(ROOT / "configs" / "local.yaml")


@pytest.fixture
def sbatch(tmp_path, monkeypatch):
    """A fake sbatch first on PATH: copies the script it is given to `script`, appends its
    arguments to `calls`, answers like Slurm."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls, script = tmp_path / "sbatch_calls", tmp_path / "sbatch_script.sh"
    fake = bin_dir / "sbatch"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\ncp "$1" {script}\n'
                    'echo "Submitted batch job 4242"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path('/usr/bin')}:{Path('/bin')}")
    return calls, script


def sbatch_block(out: str) -> str:
    """The script between the `sbatch script (...):` line and the check lists."""
    head, rest = out.split("\nsbatch script (", 1)
    return rest.split(":\n", 1)[1].split("\n\nchecks run:", 1)[0]


def test_3node_dry_run_prints_the_hetjob_and_the_plan_and_submits_nothing(sbatch, capsys):
    calls, _ = sbatch
    cfg = load_config(V4)
    assert not cfg.run_dir.exists()
    assert submit_main([V4, "--dry-run"]) == 0
    out = capsys.readouterr().out
    script = sbatch_block(out)
    assert script == make_executor(cfg).submission_text().rstrip("\n")  # the submission's text
    trainer, rollout = script.split("\n#SBATCH hetjob\n")
    assert "#SBATCH --nodes=2" in trainer and "#SBATCH --gpus-per-node=8" in trainer
    assert "#SBATCH --nodes=1" in rollout and "#SBATCH --gpus-per-node=8" in rollout
    assert "plan: FITS, estimated step 8.8 min (rollout" in out
    skipped = out.split("checks not run here:\n", 1)[1]
    assert "model checkpoint: model.path /shared/models/DeepSeek-V4-Flash-BF16 is not on" in skipped
    assert f"data: {cfg.data.train_path}, {cfg.data.eval_path}: not on this machine" in skipped
    assert "rollout checkpoint: rollout.model_path /shared/models/DeepSeek-V4-Flash-FP8" in skipped
    assert "checks run: Slurm options, expert parallelism, placement and sync backend, resume, memory plan" in out
    assert not calls.exists() and not cfg.run_dir.exists()


def test_data_here_is_checked_and_a_missing_tokenizer_is_named(sbatch, tmp_path, capsys):
    rows = "".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                   for i in range(4))
    (tmp_path / "train.jsonl").write_text(rows)
    (tmp_path / "test.jsonl").write_text(rows)
    assert submit_main([V4, "--dry-run", f"output_dir={tmp_path}/runs",
                        f"data.train_path={tmp_path}/train.jsonl",
                        f"data.eval_path={tmp_path}/test.jsonl"]) == 0
    out = capsys.readouterr().out
    assert "checks run: Slurm options, expert parallelism, placement and sync backend, resume, memory plan, data" in out
    assert ("prompt lengths: model.path /shared/models/DeepSeek-V4-Flash-BF16 is not on this "
            "machine: no tokenizer") in out
    assert not (tmp_path / "runs").exists() and not sbatch[0].exists()


def test_the_dry_run_script_is_what_a_submission_hands_sbatch(sbatch, tmp_path, capsys):
    calls, submitted = sbatch
    args = [LOCAL, "cluster.kind=slurm", f"output_dir={tmp_path}/runs", "--no-plan-check"]
    assert submit_main([*args, "--dry-run"]) == 0
    script = sbatch_block(capsys.readouterr().out)
    assert not calls.exists() and not (tmp_path / "runs").exists()
    assert submit_main(args) == 0  # the real thing, into the fake sbatch
    assert "submitted Slurm job 4242" in capsys.readouterr().out
    assert submitted.read_text().rstrip("\n") == script


def test_local_dry_run_says_what_would_start(sbatch, tmp_path, capsys):
    assert submit_main([LOCAL, "--dry-run", f"output_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert (f"local job (submitit's LocalExecutor on this machine, logs in {tmp_path}/demo/"
            "submitit): the SFT warm start (unless cached), then 2 trainer rank(s) and 1 vllm "
            "engine(s) start") in out
    assert f"run directory: {tmp_path}/demo (new: the job starts at step 0)" in out
    assert "memory plan: checked for Slurm jobs only" in out and "sbatch script" not in out
    assert list(tmp_path.iterdir()) == [tmp_path / "bin"]  # the fake sbatch's, nothing else


@pytest.mark.parametrize("overrides, needle", [
    (["trainer.zero_stag=3"], "config error: <command line>:trainer.zero_stag: unknown key"),
    (["trainer.zero_stage=3", "trainer.expert_parallel_size=1"],
     "refusing to submit, the memory plan above does not fit"),
])
def test_a_bad_config_is_still_refused_in_one_line(sbatch, overrides, needle, capsys):
    with pytest.raises(SystemExit) as exit_info:
        submit_main([V4, "--dry-run", *overrides])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert needle in lines[-1]  # the one line (after the plan's report when it does not fit)
    assert not sbatch[0].exists()

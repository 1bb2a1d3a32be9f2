"""What each start of a run logs about Slurm restarts: the launcher reads the restart count
(`job.slurm_env`) and the previous life's stop signal (`job.run.previous_stop_signal`) and passes
them into the loop (`rl.recorder.RestartInfo`); `rl/` itself reads no SLURM_ variable."""
import ast
import json
import re
from pathlib import Path

from job import slurm_env
from job.run import previous_stop_signal
from rl.recorder import RestartInfo


def _events(path, *events):
    with open(path / "lifecycle.jsonl", "w") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")


def test_first_start_outside_slurm_logs_zeros(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    info = RestartInfo(count=slurm_env.restart_count(),
                       previous_signal=previous_stop_signal(tmp_path))
    assert info.metrics() == {"slurm/restart_count": 0.0, "slurm/requeue_signal": 0.0}


def test_restart_logs_count_and_the_signal_that_stopped_the_previous_life(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    _events(tmp_path,
            {"event": "start", "restart_count": 0},
            {"event": "interrupted", "reason": "SIGTERM"},
            {"event": "start", "restart_count": 1},
            {"event": "stopped", "step": 4, "reason": "SIGUSR2"},
            {"event": "requeued", "reason": "SIGUSR2"})
    with open(tmp_path / "lifecycle.jsonl", "a") as f:
        f.write('{"event": "sta')  # a line cut by a kill is skipped
        f.write("\n" + json.dumps({"event": "start", "restart_count": 2}) + "\n")
    info = RestartInfo(count=slurm_env.restart_count(),
                       previous_signal=previous_stop_signal(tmp_path))
    assert info.metrics() == {"slurm/restart_count": 2.0, "slurm/requeue_signal": 12.0}


def test_previous_life_killed_without_a_record_logs_signal_zero(tmp_path):
    _events(tmp_path,
            {"event": "start", "restart_count": 0},
            {"event": "stopped", "reason": None},  # not a signal
            {"event": "start", "restart_count": 1})
    assert previous_stop_signal(tmp_path) == 0


def test_slurm_env_reads_het_group_variables(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_NODELIST_HET_GROUP_1", "n[2-3]")
    monkeypatch.setenv("SLURM_JOB_ID", "")
    assert slurm_env.slurm_env("nodelist_het", 1) == "n[2-3]"
    assert slurm_env.job_id() is None  # empty counts as unset


def test_rl_reads_no_slurm_environment():
    """Only job/, slurm/ and launch/ know the scheduler: no module of rl/ names a SLURM_ variable
    (a string that is one, or an f-string building one; prose that mentions one is fine)."""
    root = Path(__file__).resolve().parents[2] / "rl"
    offenders = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and re.fullmatch(r"SLURM_[A-Z0-9_{}]*", node.value)):
                offenders.append(f"{path.relative_to(root.parent)}:{node.lineno}: {node.value}")
    assert offenders == []
    # the check itself finds a read
    sample = ast.parse('import os\nos.environ.get("SLURM_JOB_ID")\nf"SLURM_{x}"')
    hits = [n for n in ast.walk(sample) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and re.fullmatch(r"SLURM_[A-Z0-9_{}]*", n.value)]
    assert len(hits) == 2

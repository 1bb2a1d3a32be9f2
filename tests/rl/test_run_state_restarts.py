"""What each start of a run logs to TensorBoard about Slurm restarts (`restart_metrics`)."""
import json

from rl.run_state import restart_metrics


def _events(path, *events):
    with open(path / "lifecycle.jsonl", "w") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")


def test_first_start_outside_slurm_logs_zeros(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert restart_metrics(tmp_path) == {"slurm/restart_count": 0.0, "slurm/requeue_signal": 0.0}


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
    assert restart_metrics(tmp_path) == {"slurm/restart_count": 2.0, "slurm/requeue_signal": 12.0}


def test_previous_life_killed_without_a_record_logs_signal_zero(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    _events(tmp_path,
            {"event": "start", "restart_count": 0},
            {"event": "stopped", "reason": None},  # not a signal
            {"event": "start", "restart_count": 1})
    assert restart_metrics(tmp_path)["slurm/requeue_signal"] == 0.0

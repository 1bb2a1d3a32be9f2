"""A job's expected ends reach the launcher as typed outcomes (a `status`), not as exception text:
a stop with a checkpoint, a config error, the requeue limit, an abort."""
import pytest

import job.run
from launch.common import EXIT_USAGE
from job.run import Requeue, exit_status, run_local_job
from rl.config import ConfigError, load_config
from rl.signals import EXIT_ABORTED, EXIT_REQUEUE


@pytest.mark.parametrize("error, status", [(Requeue("stopped on SIGTERM at step 3"), "stopped"),
                                           (ConfigError("x.yaml:seed: got -1"), "config_error")])
def test_local_job_returns_expected_ends_as_outcomes(monkeypatch, tmp_path, error, status):
    def fake_run_job(cfg, resume, force, restart_count=None):
        raise error
    monkeypatch.setattr(job.run, "run_job", fake_run_job)
    out = run_local_job(load_config(None, [f"output_dir={tmp_path}"]))
    assert out["status"] == status and out["message"] == str(error)


def test_a_failure_is_recorded_and_returned_for_the_launcher_to_restart(monkeypatch, tmp_path):
    def fake_run_job(cfg, resume, force, restart_count=None):
        e = RuntimeError("boom\nsecond line")
        e.rl_step = 5
        raise e
    monkeypatch.setattr(job.run, "run_job", fake_run_job)
    cfg = load_config(None, [f"output_dir={tmp_path}"])
    out = run_local_job(cfg, restart_count=1)
    assert out["status"] == "failure"
    assert (out["error"], out["message"], out["step"], out["restart_count"]) == \
        ("RuntimeError", "boom", 5, 1)
    from job.lifecycle import read_lifecycle
    (event,) = read_lifecycle(cfg.run_dir)
    assert event["event"] == "failure" and event["checkpoint_step"] is None


def test_a_data_error_is_a_user_error(monkeypatch, tmp_path, capsys):
    from rl.data.example import DataError

    def fake_run_job(cfg, resume, force, restart_count=None):
        raise DataError("train.jsonl:3: not UTF-8")
    monkeypatch.setattr(job.run, "run_job", fake_run_job)
    out = run_local_job(load_config(None, [f"output_dir={tmp_path}"]))
    assert out["status"] == "data_error" and exit_status(out) == EXIT_USAGE
    assert "data error: train.jsonl:3: not UTF-8" in capsys.readouterr().err


def test_exit_status_by_outcome(capsys):
    assert exit_status({"status": "done"}) == 0
    assert exit_status({"status": "aborted", "step": 4, "run_dir": "r"}) == EXIT_ABORTED
    assert exit_status({"status": "stopped", "message": "m"}) == EXIT_REQUEUE
    assert exit_status({"status": "requeue_limit", "message": "not requeueing: job 7"}) \
        == EXIT_REQUEUE
    assert exit_status({"status": "config_error", "message": "x.yaml:seed: got -1"}) == EXIT_USAGE
    assert exit_status({"status": "crash_loop", "message": "not restarting: 3 failures"}) == 1
    err = capsys.readouterr().err.splitlines()
    assert "not requeueing: job 7" in err and "config error: x.yaml:seed: got -1" in err

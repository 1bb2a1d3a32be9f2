"""A job's expected ends reach the launcher as typed outcomes (a `status`), not as exception text:
a stop with a checkpoint, a config error, the requeue limit, an abort."""
import pytest

import launch.job
from launch.common import EXIT_USAGE
from launch.job import Requeue, exit_status, run_local_job
from rl.config import ConfigError, load_config
from rl.signals import EXIT_ABORTED, EXIT_REQUEUE


@pytest.mark.parametrize("error, status", [(Requeue("stopped on SIGTERM at step 3"), "stopped"),
                                           (ConfigError("x.yaml:seed: got -1"), "config_error")])
def test_local_job_returns_expected_ends_as_outcomes(monkeypatch, tmp_path, error, status):
    def fake_run_job(cfg, resume, force):
        raise error
    monkeypatch.setattr(launch.job, "run_job", fake_run_job)
    out = run_local_job(load_config(None, [f"output_dir={tmp_path}"]))
    assert out["status"] == status and out["message"] == str(error)


def test_local_job_lets_real_failures_raise(monkeypatch, tmp_path):
    def fake_run_job(cfg, resume, force):
        raise RuntimeError("boom")
    monkeypatch.setattr(launch.job, "run_job", fake_run_job)
    with pytest.raises(RuntimeError, match="boom"):
        run_local_job(load_config(None, [f"output_dir={tmp_path}"]))


def test_exit_status_by_outcome(capsys):
    assert exit_status({"status": "done"}) == 0
    assert exit_status({"status": "aborted", "step": 4, "run_dir": "r"}) == EXIT_ABORTED
    assert exit_status({"status": "stopped", "message": "m"}) == EXIT_REQUEUE
    assert exit_status({"status": "requeue_limit", "message": "not requeueing: job 7"}) \
        == EXIT_REQUEUE
    assert exit_status({"status": "config_error", "message": "x.yaml:seed: got -1"}) == EXIT_USAGE
    err = capsys.readouterr().err.splitlines()
    assert "not requeueing: job 7" in err and "config error: x.yaml:seed: got -1" in err

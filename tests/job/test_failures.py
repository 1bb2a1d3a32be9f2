"""After a failure: user errors end the run (exit 2), other failures give it a new life up to
cluster.max_requeues, and a crash that repeats without a new checkpoint stops after
cluster.max_failures_without_progress failures. The local launcher's restart loop and
`launch.status` are checked with the job replaced by canned outcomes."""
import json
import types

import pytest

from job import failures
from launch import submit
from launch.common import EXIT_USAGE
from job.failures import failures_without_progress, is_failure, next_life, record_failure
from job.lifecycle import lifecycle
from job.rundir import RunDirBusy
from launch.status import describe_stop, read_lifecycle, status
from rl.checkpoint import NoIntactCheckpoint
from rl.cluster.actors import ActorDied, CallTimeout
from rl.config import ConfigError, load_config
from rl.data.example import DataError
from rl.safe_load import UnsafeCheckpointError
from rl.signals import EXIT_REQUEUE


@pytest.fixture
def cfg(tmp_path):
    return load_config(None, [f"output_dir={tmp_path}", "name=run", "cluster.max_requeues=5",
                              "cluster.max_failures_without_progress=3"])


@pytest.mark.parametrize("error, failure", [
    (ConfigError("x.yaml:seed: got -1"), False), (DataError("a.jsonl:3: not UTF-8"), False),
    (RunDirBusy("in use"), False), (NoIntactCheckpoint("none intact"), False),
    (UnsafeCheckpointError("driver.pt: class X"), False),
    (ActorDied("trainer-1 died"), True), (CallTimeout("train_step", 10.0), True),
    (RuntimeError("NCCL abort"), True), (OSError(28, "No space left on device"), True),
    (KeyboardInterrupt(), False), (SystemExit(1), False)])
def test_user_errors_end_the_run_and_every_other_exception_is_a_failure(error, failure):
    assert is_failure(error) is failure


def fail(cfg, step, ckpt, restarts, error=ActorDied("trainer-1 (pid 42) died")):
    """A failure event as `record_failure` writes it, with the newest checkpoint at `ckpt`."""
    error.rl_step = step
    failures.newest_checkpoint_step = lambda _run_dir: ckpt  # noqa: E731 - no checkpoints here
    return record_failure(cfg, error, restarts)


@pytest.fixture(autouse=True)
def _restore(monkeypatch):
    monkeypatch.setattr(failures, "newest_checkpoint_step", failures.newest_checkpoint_step)


def test_a_failure_restarts_from_the_newest_checkpoint_in_one_line(cfg):
    event = fail(cfg, step=5, ckpt=4, restarts=0)
    verdict = next_life(cfg, 0, event)
    assert verdict.restart and verdict.outcome == {}
    assert verdict.line == ("step 5 failed (ActorDied: trainer-1 (pid 42) died); restarting from "
                            "the checkpoint at step 4 (restart 1 of at most 5)")
    (recorded,) = read_lifecycle(cfg.run_dir)
    assert {k: recorded[k] for k in ("event", "error", "message", "step", "checkpoint_step",
                                     "restart_count")} == {
        "event": "failure", "error": "ActorDied", "message": "trainer-1 (pid 42) died",
        "step": 5, "checkpoint_step": 4, "restart_count": 0}


def test_the_crash_loop_guard_counts_failures_without_a_new_checkpoint(cfg):
    fail(cfg, 3, 2, 0)                       # progress after it: not counted
    lifecycle(cfg, "requeued", reason="failure")
    lifecycle(cfg, "start", restart_count=1)
    assert next_life(cfg, 1, fail(cfg, 5, 4, 1)).restart
    lifecycle(cfg, "start", restart_count=2)
    assert next_life(cfg, 2, fail(cfg, 5, 4, 2)).restart
    lifecycle(cfg, "start", restart_count=3)
    verdict = next_life(cfg, 3, fail(cfg, 5, 4, 3))  # the third at checkpoint 4
    assert not verdict.restart and verdict.outcome["status"] == "crash_loop"
    assert verdict.line.startswith("step 5 failed (ActorDied: trainer-1 (pid 42) died); not "
                                   "restarting: 3 failures in a row without a new checkpoint "
                                   "(cluster.max_failures_without_progress=3)")
    assert failures_without_progress(read_lifecycle(cfg.run_dir)) == 3
    lifecycle(cfg, "stopped", reason="SIGTERM")  # any other end breaks the row
    assert failures_without_progress(read_lifecycle(cfg.run_dir)) == 0


def test_past_max_requeues_the_outcome_is_requeue_limit(cfg):
    verdict = next_life(cfg, 5, fail(cfg, 9, 8, 5))
    assert not verdict.restart and verdict.outcome["status"] == "requeue_limit"
    assert "already restarted 5 times (cluster.max_requeues=5)" in verdict.line


class FakeLife:
    """`submit.LocalLife` with the job replaced by canned outcomes, one per life."""

    def __init__(self, cfg, outcomes):
        self.cfg, self.outcomes, self.lives, self.stopping = cfg, list(outcomes), [], False

    def __call__(self, executor, cfg, args):
        return self

    def run(self, restart_count):
        self.lives.append(restart_count)
        lifecycle(self.cfg, "start", restart_count=restart_count)
        kind, *rest = self.outcomes.pop(0)
        if kind == "fail":
            step, ckpt = rest
            failures.newest_checkpoint_step = lambda _run_dir: ckpt  # noqa: E731
            e = ActorDied("trainer-1 died")
            e.rl_step = step
            return {"status": "failure", **record_failure(self.cfg, e, restart_count)}
        return {"status": kind, "message": "x.yaml:seed: got -1", "step": 6,
                "run_dir": str(self.cfg.run_dir)}


def launch(monkeypatch, cfg, *outcomes):
    life = FakeLife(cfg, outcomes)
    monkeypatch.setattr(submit, "LocalLife", life)
    rc = submit.run_local(cfg, types.SimpleNamespace(force=False))
    return rc, life.lives


def test_the_local_launcher_restarts_after_a_failure_and_finishes(monkeypatch, cfg, capsys):
    rc, lives = launch(monkeypatch, cfg, ("fail", 5, 4), ("done",))
    assert (rc, lives) == (0, [0, 1])
    assert ("step 5 failed (ActorDied: trainer-1 died); restarting from the checkpoint at step "
            "4 (restart 1 of at most 5)") in capsys.readouterr().out.splitlines()
    assert describe_stop(read_lifecycle(cfg.run_dir)) == (
        "restarted after a failure in step 5 (ActorDied: trainer-1 died); resumes from the "
        "checkpoint at step 4")


def test_a_config_error_exits_2_without_a_restart(monkeypatch, cfg, capsys):
    rc, lives = launch(monkeypatch, cfg, ("config_error",), ("done",))
    assert (rc, lives) == (EXIT_USAGE, [0])
    assert "config error: x.yaml:seed: got -1" in capsys.readouterr().err


def test_the_local_launcher_stops_a_crash_loop(monkeypatch, cfg, capsys):
    rc, lives = launch(monkeypatch, cfg, ("fail", 3, 2), ("fail", 3, 2), ("fail", 3, 2),
                       ("done",))
    assert (rc, lives) == (failures.EXIT_FAILED, [0, 1, 2])
    assert "3 failures in a row without a new checkpoint" in capsys.readouterr().err
    assert read_lifecycle(cfg.run_dir)[-1]["event"] == "crash_loop"


def test_the_local_launcher_stops_at_max_requeues(monkeypatch, cfg):
    cfg.cluster.max_requeues = 2
    rc, lives = launch(monkeypatch, cfg, ("fail", 3, 2), ("fail", 5, 4), ("fail", 7, 6))
    assert (rc, lives) == (EXIT_REQUEUE, [0, 1, 2])


def test_status_shows_the_failures(cfg, capsys):
    lifecycle(cfg, "start", restart_count=0)
    (cfg.run_dir / "config.yaml").write_text("name: run\n")
    fail(cfg, 7, 6, 0)
    lifecycle(cfg, "requeued", reason="failure", restart_count=0)
    lifecycle(cfg, "start", restart_count=1)
    st = status(cfg.run_dir)
    assert st["restarts"] == 1 and st["failures"] == 1
    assert st["last_stop_text"] == ("requeued after a failure in step 7 (ActorDied: trainer-1 "
                                    "(pid 42) died); resumes from the checkpoint at step 6")
    from launch.status import main
    assert main([str(cfg.run_dir)]) == 0
    assert ("restarts:   1, failures: 1  (last: requeued after a failure in step 7"
            in capsys.readouterr().out)
    json.dumps(st)

"""One writer per run directory (`job.rundir.RunDirLock`), with real processes: a second local
run, `--no-resume` and a second Slurm job are refused with exit 2 and one line naming the holder;
a killed run's lock is taken over; a requeued Slurm job (same SLURM_JOB_ID, restart + 1) takes its
own lock over. Slurm's answer about a job comes from a stand-in `squeue` on PATH (the real cluster
is tests/slurm's)."""
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from job.rundir import LOCK_FILE, RunDirBusy, RunDirLock, archive_run_dir
from rl.signals import STOP_SIGNALS

ROOT = Path(__file__).resolve().parents[2]
LOCAL = str(ROOT / "configs" / "local.yaml")
HOLD = """
import sys, time
from job.rundir import RunDirLock
RunDirLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def env(**extra):
    e = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**e, "PYTHONPATH": str(ROOT), **extra}


def holder(run_dir, seconds=120.0, **extra) -> subprocess.Popen:
    """A process that takes the lock of `run_dir`, then sleeps (a run in progress)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir), str(seconds)], cwd=ROOT,
                            env=env(**extra), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def submit(out_dir, *args, **extra):
    return subprocess.run([sys.executable, "-m", "launch.submit", LOCAL, f"output_dir={out_dir}",
                           "name=run", *args], cwd=ROOT, env=env(**extra), capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def squeue(tmp_path, monkeypatch):
    """A stand-in `squeue` on PATH; `squeue(state)` sets what it says about every job (None:
    the job is gone, as squeue says once a finished job has left the controller)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    state = bindir / "state"
    (bindir / "squeue").write_text(
        f'#!/bin/sh\nif [ -s {state} ]; then cat {state}; else echo "slurm_load_jobs error: '
        'Invalid job id specified" >&2; exit 1; fi\n')
    (bindir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")

    def set_state(s):
        state.write_text(f"{s}\n" if s else "")
    set_state(None)
    return set_state


def test_a_second_local_run_and_no_resume_are_refused_naming_the_holder(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("")
    first = holder(run_dir)
    try:
        for extra in ([], ["--no-resume"]):
            proc = submit(tmp_path, *extra)
            assert proc.returncode == 2, proc.stdout + proc.stderr
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
            assert (f"{run_dir} is in use by a local run (pid {first.pid} on "
                    f"{socket.gethostname()} since ") in lines[0]
        assert run_dir.is_dir() and not list(tmp_path.glob("run.old-*"))  # not moved aside
        with pytest.raises(RunDirBusy):
            archive_run_dir(run_dir)
        # The job itself refuses too (a second launcher that got past its check)
        from job.run import exit_status, run_local_job
        from rl.config import load_config
        out = run_local_job(load_config(LOCAL, [f"output_dir={tmp_path}", "name=run"]))
        assert out["status"] == "busy" and exit_status(out) == 2
    finally:
        first.kill()
        first.wait()


def test_the_lock_of_a_killed_run_is_taken_over(tmp_path, caplog):
    run_dir = tmp_path / "run"
    first = holder(run_dir)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    with caplog.at_level(logging.INFO, logger="job.rundir"):
        lock = RunDirLock(run_dir).acquire()
    try:
        assert f"taking over from a local run (pid {first.pid} on" in caplog.text
        assert lock.owner()["pid"] == os.getpid()
    finally:
        lock.release()
    assert archive_run_dir(run_dir) is not None  # free again once released


def test_a_requeued_slurm_job_takes_its_lock_over_and_another_job_is_refused(tmp_path, squeue,
                                                                            monkeypatch):
    run_dir = tmp_path / "run"
    life0 = holder(run_dir, 3.0, SLURM_JOB_ID="123", SLURM_RESTART_COUNT="0")
    # The requeued life starts while the old one is still ending: it waits for it.
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    t0 = time.monotonic()
    lock = RunDirLock(run_dir).acquire(wait_same_job_s=60)
    assert time.monotonic() - t0 > 1.0 and life0.wait(10) == 0
    assert (lock.owner()["job_id"], lock.owner()["restart_count"]) == ("123", 1)
    lock.release()  # this life ends; the job is requeued again and waits in the queue
    squeue("PENDING")
    monkeypatch.setenv("SLURM_JOB_ID", "456")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    with pytest.raises(RunDirBusy, match=r"is in use by Slurm job 123 \(PENDING; restart 1, pid "):
        RunDirLock(run_dir).acquire()
    proc = submit(tmp_path, "--no-resume", SLURM_JOB_ID="456")
    assert proc.returncode == 2 and "in use by Slurm job 123 (PENDING" in proc.stderr
    # Job 456 started anyway (sbatch by hand): it ends at once, before Ray, with exit status 2
    from job.run import exit_status
    from rl.config import load_config
    from slurm.allocation import slurm_main
    handlers = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    try:
        out = slurm_main(load_config(LOCAL, [f"output_dir={tmp_path}", "name=run"]))
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert out["status"] == "busy" and exit_status(out) == 2
    assert not (run_dir / "ray_auth_token").exists() and not (run_dir / "lifecycle.jsonl").exists()
    squeue(None)  # job 123 ended and left the controller: its record is stale
    RunDirLock(run_dir).acquire().release()


def test_a_submitted_job_holds_the_directory_while_it_waits_in_the_queue(tmp_path, squeue):
    run_dir = tmp_path / "run"
    RunDirLock(run_dir).reserve("789")  # what slurm.sbatch records after sbatch
    squeue("PENDING")
    proc = submit(tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (f"in use by Slurm job 789 (PENDING; restart 0, submitted from "
            f"{socket.gethostname()} at ") in proc.stderr
    squeue("COMPLETED")
    RunDirLock(run_dir).check()  # a finished job holds nothing
    assert (run_dir / LOCK_FILE).stat().st_mode & 0o777 == 0o600


def test_resume_from_an_older_step(tmp_path):
    from launch.submit import resume_from_or_exit
    from rl.checkpoint import CheckpointManager
    from rl.config import load_config
    cfg = load_config(LOCAL, [f"output_dir={tmp_path}", "name=run"])
    mgr = CheckpointManager(cfg.run_dir)
    for step in (3, 6):
        mgr.save(step, step, "h", lambda tmp: (tmp / "driver.pt").write_text("x") and None)
    proc = submit(tmp_path, "--resume-from", "4")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().endswith("step_000004: no such checkpoint (complete checkpoints: "
                                        "steps 3, 6)")
    resume_from_or_exit(cfg, 3)
    assert mgr.complete_steps() == [3] and (mgr.root / "abandoned").is_dir()

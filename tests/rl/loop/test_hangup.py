"""An ssh session that drops mid-run: `launch.submit` runs in a session of its own on a pseudo-
terminal, and the terminal's master side is closed, which is what sshd does. The kernel then
sends SIGHUP to the session's foreground process group (the launcher, submitit's controller, the
job, Ray's GCS and raylet). The run must checkpoint and the launcher exit with 75, resumable."""
import fcntl
import os
import pty
import select
import signal
import subprocess
import termios
import threading

import pytest

from rl.checkpoint import CheckpointManager
from tests.rl.loop.conftest import ROOT, read_metrics, submit_cmd, wait_for

pytestmark = pytest.mark.slow


def _controlling_terminal() -> None:
    """In the child: a new session whose controlling terminal is stdin (the pty's slave)."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)  # a terminal's session, even if pytest runs nohup


def test_hangup_checkpoints_and_exits_resumable(tmp_path):
    master, slave = pty.openpty()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    cheap = ["rollout.engine=hf", "model.warm_start=false", "num_steps=50", "eval.every=0",
             "eval.at_start=false", "checkpoint.every=0"]
    proc = subprocess.Popen(submit_cmd(tmp_path, "hup", *cheap), cwd=ROOT, env=env, stdin=slave,
                            stdout=slave, stderr=slave, preexec_fn=_controlling_terminal)
    os.close(slave)
    seen, hangup = bytearray(), threading.Event()

    def drain():  # the launcher blocks on a full terminal otherwise
        while not hangup.is_set():
            if select.select([master], [], [], 0.2)[0]:
                try:
                    seen.extend(os.read(master, 4096))
                except OSError:
                    return

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    run_dir = tmp_path / "hup"
    try:
        wait_for(lambda: len(read_metrics(run_dir)) >= 1, 600, "step 1", proc)
        hangup.set()
        reader.join(5)
        os.close(master)  # the session drops: its last reference to the terminal is gone
        code = proc.wait(300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert code == 75, seen.decode(errors="replace")[-3000:]
    latest = CheckpointManager(run_dir).latest()
    assert latest is not None
    steps = [m["step"] for m in read_metrics(run_dir)]
    assert latest[1]["step"] == steps[-1] >= 1 and steps[-1] < 50
    log = (run_dir / "driver.log").read_text()
    assert "received SIGTERM: will checkpoint" in log  # the launcher forwarded the hangup

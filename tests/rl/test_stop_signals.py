"""A hangup (SIGHUP: the ssh session dropped) is a stop signal like TERM and Ctrl-C, unless the
process was started to outlive its session (`nohup`: HUP ignored); workers ignore it."""
import os
import signal
import subprocess
import sys
from pathlib import Path

from rl.signals import StopRequest

ROOT = Path(__file__).resolve().parents[2]


def test_a_hangup_requests_a_stop():
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # a terminal, even if pytest runs nohup
    stop = StopRequest().install()
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        assert stop.requested and stop.signal_name == "SIGHUP"
    finally:
        stop.uninstall()
        signal.signal(signal.SIGHUP, previous)


def test_a_hangup_ignored_at_start_stays_ignored():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    try:
        stop = StopRequest().install()
        os.kill(os.getpid(), signal.SIGHUP)
        assert not stop.requested and signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        stop.uninstall()
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_workers_survive_a_hangup_of_their_process_group():
    code = ("import os, signal; from rl.signals import shield_worker; shield_worker(); "
            "[os.kill(os.getpid(), s) for s in (signal.SIGHUP, signal.SIGINT, signal.SIGUSR1)]; "
            "print('alive')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and proc.stdout.strip() == "alive", proc.stderr

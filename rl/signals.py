"""Graceful stop: SIGUSR1, SIGUSR2, SIGTERM, SIGINT and SIGHUP ask the driver to checkpoint and
exit.

Slurm sends USR2 (the sbatch's `--signal=USR2@cluster.signal_before_end_s`, submitit's
preemption signal) before a time limit or, with preempt_send_user_signal, before a preemption;
`scontrol requeue` and plain preemption send TERM; the local launcher forwards Ctrl-C and a
hangup (HUP: the ssh session dropped) as TERM, and USR1 is honoured too. All mean the same
thing: stop at the next safe point, save, exit with EXIT_REQUEUE so the Slurm layer requeues the
job. A process started with HUP ignored (`nohup`) keeps ignoring it: the run outlives the session,
as asked.
"""
from __future__ import annotations

import logging
import signal
import time
from typing import Any

log = logging.getLogger(__name__)

EXIT_REQUEUE = 75
"""Exit status of a run that stopped on a signal after checkpointing (EX_TEMPFAIL)."""
EXIT_ABORTED = 3
"""Exit status of a run that aborted (too many non-finite steps) after checkpointing."""

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StepAbandoned(Exception):
    """A stop request cut the step short before it trained (a generation or the reward scoring
    given up on): nothing persistent changed, the run checkpoints the previous step."""


def shield_worker() -> None:
    """In worker processes (trainer ranks, engines): ignore the stop signals meant for the driver.

    A terminal's Ctrl-C or hangup, or Slurm's USR1, reaches every process of the group; the
    workers must stay alive so the driver can still write its checkpoint. (SIGTERM is left
    alone: it is how a worker is told to go away.) Ignored signals stay ignored in the processes
    a worker starts (vLLM's engine core).
    """
    import threading
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


class StopRequest:
    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.received_at: float | None = None
        self._previous: dict[int, Any] = {}  # signal -> the handler it replaced

    def install(self) -> "StopRequest":
        """Idempotent: call it again after `ray.init`, which replaces the SIGTERM handler. A
        hangup that this process ignores (`nohup`, or the local launcher's job, to which the
        launcher forwards it as TERM) stays ignored."""
        for sig in STOP_SIGNALS:
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, _frame) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            self.received_at = time.monotonic()
            log.warning("received %s: will checkpoint at the next safe point and exit",
                        self.signal_name)

    def request(self, reason: str) -> None:
        """Programmatic stop (tests, the Slurm layer)."""
        if self.signal_name is None:
            self.signal_name, self.received_at = reason, time.monotonic()

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def seconds_left(self, grace_s: float) -> float:
        """Of `grace_s` (checkpoint.grace_period_s) after the stop request; inf without one."""
        if self.received_at is None:
            return float("inf")
        return grace_s - (time.monotonic() - self.received_at)

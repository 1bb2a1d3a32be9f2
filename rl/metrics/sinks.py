"""The one place a run's scalars fan out: TensorBoard first, then the tracking sinks (W&B, MLflow).

`MetricFanOut.log(step, metrics)` hands the same numbers, at the same step, to every sink.
TensorBoard (`MetricsLogger`) goes first: `MetricsLogger.numbers` checks the tags against
`METRIC_TAGS` and turns the values into floats (raising on a bad one, before any sink sees it),
and every sink gets those floats. Only the driver builds a fan-out (`rl.recorder.Recorder`): trainer ranks and
engines never log.

A tracking sink talks to a server or a file store that the run does not control. Each runs in a
`GuardedSink`: its calls (open, log, close) run in order on a thread of its own, so a slow or
unreachable server never holds up a step, and an exception is logged once as a warning and
counted, never raised: training goes on and TensorBoard keeps every scalar. A sink whose `open`
failed logs nothing for the rest of that life of the run.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Mapping, Protocol

from rl.metrics.tensorboard import MetricsLogger

log = logging.getLogger(__name__)

Outcome = str
"""How a life of the run ended, for the trackers' run status: `done`, `stopped` (checkpointed,
to be resumed), `aborted` (non-finite steps) or `failed` (an exception)."""

MAX_QUEUED = 10_000
"""Calls a tracking sink may have waiting; beyond, new steps are dropped for that sink (warned)."""
CLOSE_TIMEOUT_S = 120.0
"""How long closing waits for a sink to send what it has queued and finish its run."""


class TrackingSink(Protocol):
    """A tracker the scalars go to besides TensorBoard. Every method may raise (`GuardedSink`
    reports it); `log` gets plain floats, already checked against `METRIC_TAGS`."""
    name: str

    def open(self) -> None:
        """Create the tracker's run, or resume the one this run directory recorded."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self, outcome: Outcome) -> None:
        """Finish the tracker's run (`outcome`: how this life ended)."""


class GuardedSink:
    """Runs one `TrackingSink` on a daemon thread: calls are queued in order and never block or
    raise in the caller. The first failure is logged as a warning; later ones are counted and
    reported when the sink closes."""

    def __init__(self, sink: TrackingSink):
        self.sink = sink
        self.name = sink.name
        self.calls = 0
        self.failures = 0
        self.dropped = 0
        self._opened = False
        self._warned_full = False
        self._queue: queue.Queue[tuple[str, tuple[Any, ...]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name=f"metrics-{self.name}",
                                        daemon=True)
        self._thread.start()
        self._queue.put(("open", ()))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._queue.qsize() >= MAX_QUEUED:
            self.dropped += 1
            if not self._warned_full:
                self._warned_full = True
                log.warning("%s: %d calls are waiting (the tracker is not keeping up); step %d "
                            "and later ones are not sent to it while that lasts", self.name,
                            MAX_QUEUED, step)
            return
        self._queue.put(("log", (step, dict(metrics))))

    def close(self, outcome: Outcome, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Finish the sink's run and wait up to `timeout_s` for its thread."""
        self._queue.put(("close", (outcome,)))
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("%s: still busy after %.0f s at close (%d calls left); not waiting "
                        "longer", self.name, timeout_s, self._queue.qsize())
        elif self.failures or self.dropped:
            log.warning("%s: %d of %d calls failed, %d steps dropped; TensorBoard has every "
                        "scalar", self.name, self.failures, self.calls, self.dropped)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            what, args = item
            if what != "open" and not self._opened:
                continue  # its run never opened: nothing to log into or finish
            self.calls += 1
            try:
                getattr(self.sink, what)(*args)
            except Exception as e:  # noqa: BLE001 - a tracker must never stop training
                self.failures += 1
                if self.failures == 1:
                    first = str(e).splitlines()[0] if str(e) else ""
                    log.warning("%s: %s failed (%s: %s); training goes on without it%s",
                                self.name, what, type(e).__name__, first[:300],
                                "" if what == "open" else "; later failures are counted")
                log.debug("%s: %s failed", self.name, what, exc_info=True)
                continue
            self._opened = self._opened or what == "open"


class MetricFanOut:
    """TensorBoard and the tracking sinks, fed by one `log` call (see the module doc)."""

    def __init__(self, tensorboard: MetricsLogger, tracking: list[GuardedSink] | None = None):
        self.tensorboard = tensorboard
        self.tracking = list(tracking or [])

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        numbers = self.tensorboard.numbers(metrics)  # raises on an undocumented tag or value
        self.tensorboard.log(step, numbers)
        self.tensorboard.flush()
        for sink in self.tracking:
            sink.log(step, numbers)

    def histogram(self, step: int, tag: str, values) -> None:
        """TensorBoard only: the tracking sinks get scalars."""
        self.tensorboard.histogram(step, tag, values)

    def close(self, outcome: Outcome = "done") -> None:
        try:
            for sink in self.tracking:
                sink.close(outcome)
        finally:
            self.tensorboard.close()

"""What happens after a run fails: a failure the user must fix ends it; any other is recorded
and the run goes on in a new life (Slurm: the job requeues itself; local: the launcher restarts
the job), resuming from its newest intact checkpoint.

- A user error (`USER_ERRORS`: the config, the data, a reward plugin that cannot be imported, a
  run directory another run holds, a checkpoint that is unsafe to load) needs a person: exit
  status 2, no new life (the same error would come back).
- Every other exception from the run is a *failure*: a trainer rank that crashed, a Ray actor or
  node that died (`ActorDied`), a remote call past its deadline (`CallTimeout`,
  `cluster.deadlines`), a weight sync that broke, a full disk. It is recorded as a `failure`
  event in RUN_DIR/lifecycle.jsonl (error type, first line of the message, the step it failed
  in, the newest checkpoint's step, the restart count), then `next_life` decides:
  restart, unless `cluster.max_requeues` lives are used up (outcome `requeue_limit`), or the run
  failed `cluster.max_failures_without_progress` times in a row with no new checkpoint between
  the failures (outcome `crash_loop`: a deterministic crash must not use up every life).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from job.lifecycle import lifecycle, read_lifecycle
from rl.config import Config

EXIT_USAGE = 2
"""Exit status of a user error: the config, the data, a run directory another run holds."""
EXIT_FAILED = 1
"""Exit status of a run that failed and is not restarted (a crash loop)."""


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types a person must fix; a new life would only fail the same way."""
    from rl.config import ConfigError  # also RunDirBusy, NoIntactCheckpoint, ModelConfigError
    from rl.data.example import DataError
    from rl.quant.backends import BackendUnavailableError
    from rl.safe_load import UnsafeCheckpointError
    return ConfigError, DataError, BackendUnavailableError, UnsafeCheckpointError


def is_failure(error: BaseException) -> bool:
    """True for an error that a new life may get past (requeue / restart); False for a user
    error (exit 2) and for what is not an Exception (KeyboardInterrupt, SystemExit)."""
    return isinstance(error, Exception) and not isinstance(error, user_errors())


def first_line(error: BaseException) -> str:
    """`Type: the first line of its message` (Ray's wrapped errors keep the original type)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def newest_checkpoint_step(run_dir: Path) -> int | None:
    """The step of the newest complete checkpoint (its manifest written), None without one."""
    from rl.checkpoint import CheckpointManager
    if not (run_dir / "checkpoints").is_dir():
        return None
    steps = CheckpointManager(run_dir).complete_steps()
    return steps[-1] if steps else None


def record_failure(cfg: Config, error: BaseException, restart_count: int) -> dict:
    """Appends the `failure` event to RUN_DIR/lifecycle.jsonl and returns it."""
    text = str(error).strip()
    event = {"error": type(error).__name__, "message": text.splitlines()[0] if text else "",
             "step": getattr(error, "rl_step", None),
             "checkpoint_step": newest_checkpoint_step(cfg.run_dir),
             "restart_count": restart_count}
    lifecycle(cfg, "failure", **event)
    return {"event": "failure", **event}


def failures_without_progress(events: list[dict]) -> int:
    """How many failures in a row, the newest last, found the same newest checkpoint (no new
    checkpoint between them). Starts and requeues between them do not break the row; any other
    end (a stop, a finished run) does."""
    count, step = 0, None
    for e in reversed(events):
        kind = e.get("event")
        if kind in ("start", "requeued", "restarting", "interrupted"):
            continue
        if kind != "failure" or (count and e.get("checkpoint_step") != step):
            break
        count, step = count + 1, e.get("checkpoint_step")
    return count


@dataclass(frozen=True, slots=True)
class NextLife:
    restart: bool
    """Start a new life (requeue, restart)."""
    outcome: dict = field(default_factory=dict)
    """Otherwise the run's end: {"status": "requeue_limit" | "crash_loop", "message", ...}."""
    line: str = ""
    """One line for the console: what failed and what happens now."""


def next_life(cfg: Config, restart_count: int, failure: dict, verb: str = "restarting"
              ) -> NextLife:
    """Whether the run that recorded `failure` (`record_failure`) gets a new life, given the
    `restart_count` of the life that failed and the run's lifecycle so far."""
    step = failure.get("step")
    what = f"step {step} failed" if step is not None else "the run failed"
    error = f"{failure['error']}: {failure['message']}".rstrip(": ")
    ckpt = failure.get("checkpoint_step")
    where = (f"the checkpoint at step {ckpt}" if ckpt is not None else
             "the start (no checkpoint yet)")
    in_a_row = failures_without_progress(read_lifecycle(cfg.run_dir))
    guard = cfg.cluster.max_failures_without_progress
    limit = cfg.cluster.max_requeues
    base = {"run_dir": str(cfg.run_dir), "step": step, "checkpoint_step": ckpt}
    if in_a_row >= guard:
        msg = (f"{what} ({error}); not restarting: {in_a_row} failures in a row without a new "
               f"checkpoint (cluster.max_failures_without_progress={guard}), a crash that "
               f"repeats. Fix the cause, then run the same command to resume from {where}.")
        return NextLife(False, {"status": "crash_loop", "message": msg, **base}, msg)
    if restart_count >= limit:
        msg = (f"{what} ({error}); not restarting: already restarted {restart_count} times "
               f"(cluster.max_requeues={limit}). Run the same command to resume from {where}.")
        return NextLife(False, {"status": "requeue_limit", "message": msg, **base}, msg)
    return NextLife(True, {}, f"{what} ({error}); {verb} from {where} "
                                f"(restart {restart_count + 1} of at most {limit})")

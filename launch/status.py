"""`python -m launch.status RUN_DIR`: the job's state, current step, restarts, latest checkpoint."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from job.lifecycle import read_jsonl, read_lifecycle
from launch.common import fail


def slurm_state(job_id: str) -> str:
    """State from squeue (pending/running) or sacct (finished); 'unknown' without Slurm."""
    for cmd in (["squeue", "-h", "-j", job_id, "-o", "%T"],
                ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"]):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out:
            return out[0]
    return "unknown"


LAST_EVENTS = ("stopped", "requeued", "interrupted", "restarting", "failure", "requeue_limit",
               "crash_loop")


def describe_stop(events: list[dict]) -> str:
    """How the newest life ended, for `restarts:` (e.g. `requeued after a failure in step 7
    (ActorDied: ...); resumed from the checkpoint at step 6`), '' when nothing stopped it."""
    last = next((i for i in range(len(events) - 1, -1, -1)
                 if events[i].get("event") in LAST_EVENTS), None)
    if last is None:
        return ""
    e = events[last]
    failure = next((f for f in reversed(events[:last + 1]) if f.get("event") == "failure"), None)
    if e.get("reason") != "failure" and e.get("event") not in ("failure", "crash_loop") \
            or failure is None:
        return f"{e['event']} on {e.get('reason')}"
    step = failure.get("step")
    what = f"a failure in step {step}" if step is not None else "a failure"
    error = f"{failure.get('error')}: {failure.get('message', '')}".rstrip(": ")
    ckpt = failure.get("checkpoint_step")
    since = f"checkpoint at step {ckpt}" if ckpt is not None else "start"
    verb = {"requeued": "requeued after", "restarting": "restarted after",
            "failure": "", "crash_loop": "stopped (crash loop) after",
            "requeue_limit": "stopped (cluster.max_requeues) after"}.get(e["event"], "")
    return f"{verb} {what} ({error}); resumes from the {since}".strip()


def status(run_dir: Path) -> dict:
    from rl.checkpoint import CheckpointManager
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    events = read_lifecycle(run_dir)
    latest = CheckpointManager(run_dir).latest() if (run_dir / "checkpoints").exists() else None
    job = json.loads((run_dir / "slurm_job.json").read_text()) if (run_dir / "slurm_job.json").exists() else None
    starts = [e for e in events if e.get("event") == "start"]
    return {
        "run_dir": str(run_dir),
        "job_id": job.get("job_id") if job else None,
        "state": slurm_state(str(job["job_id"])) if job else (events[-1]["event"] if events else "unknown"),
        "step": metrics[-1]["step"] if metrics else 0,
        "restarts": max((e.get("restart_count", 0) for e in starts), default=0),
        "last_stop": next((e for e in reversed(events) if e.get("event") in LAST_EVENTS), None),
        "last_stop_text": describe_stop(events),
        "failures": sum(e.get("event") == "failure" for e in events),
        "latest_checkpoint": str(latest[0]) if latest else None,
        "latest_checkpoint_step": latest[1]["step"] if latest else None,
        "last_eval_pass1": next((m["eval/pass1"] for m in reversed(metrics) if "eval/pass1" in m), None),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("run_dir")
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not (run_dir / "config.yaml").is_file():
        fail(f"{run_dir}: not a run directory (no config.yaml)")
    st = status(run_dir)
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    stop = st["last_stop"]
    print(f"run:        {st['run_dir']}")
    print(f"job:        {st['job_id'] or 'local'}  state: {st['state']}")
    print(f"step:       {st['step']}")
    failures = f", failures: {st['failures']}" if st["failures"] else ""
    print(f"restarts:   {st['restarts']}{failures}"
          + (f"  (last: {st['last_stop_text']})" if stop else ""))
    print(f"checkpoint: {st['latest_checkpoint'] or 'none'}")
    if st["last_eval_pass1"] is not None:
        print(f"eval pass@1 (latest): {st['last_eval_pass1']:.3f}")
    print(f"TensorBoard: tensorboard --logdir {run_dir / 'tensorboard'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

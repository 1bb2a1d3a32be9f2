"""The RL job as one heterogeneous Slurm job on the real test cluster: 2 trainer nodes (n1, n2)
+ 1 rollout node (n3), Ray spanning them, requeue and preemption with exact resume.

Two runs of configs/slurm_cpu_test.yaml go side by side (module fixture `runs`, ~10 min):
- `reference`: `python -m launch.submit ... --wait`, in the `urgent` partition (never preempted)
  with 1 CPU per node: uninterrupted, 10 steps (NUM_STEPS) of about a second each.
- `interrupted`: the same config in `batch` with 2 CPUs per node, submitted without --wait. Once
  it logged step 3 it is requeued from outside (`scontrol requeue`: SIGTERM to every step, Ray
  dies, the restart resumes from the last complete checkpoint); once the restarted job logged a
  new step, an `urgent` job asking for 3 of n1's 4 CPUs preempts it (Slurm sends USR2 first:
  the driver checkpoints and requeues). In the next life a trainer process is SIGKILLed in the
  middle of a step (the driver fails at once, records the failure and requeues the job), and in
  the one after, node n2 is lost: every process in its network namespace is killed (its slurmd,
  Ray's raylet, a trainer rank), then the node is started again (`slurm/testing/start.sh`). The
  run must end with the reference's per-step metrics.
The preemptor can only start by preempting `interrupted` (2 CPUs on n1), whether the reference
(1 CPU) still runs or not, so its target is deterministic.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from job.lifecycle import read_jsonl
from slurm.testing.client import backfill_kicked, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "slurm_cpu_test.yaml"
_NET = os.environ.get("RL_SLURM_NET", "10.213.7")  # as in slurm/testing/config.sh
NODE_IPS = {"n1": f"{_NET}.11", "n2": f"{_NET}.12", "n3": f"{_NET}.13"}
COMPARED = ("reward/mean", "reward/std", "train/loss", "train/kl", "train/grad_norm",
            "train/entropy", "rollout/response_length", "eval/pass1")
RUN_TIMEOUT_S = 1500
NUM_STEPS = yaml.safe_load(CONFIG.read_text())["num_steps"]  # room for both interruptions


def _submit_cmd(out: Path, name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "launch.submit", str(CONFIG), f"output_dir={out}",
            f"name={name}", *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}



def job_output(run_dir: Path) -> str:
    job = json.loads((run_dir / "slurm_job.json").read_text())
    path = Path(job["stdout"])
    return path.read_text(errors="replace") if path.exists() else ""


def leader_state(job_id: str) -> str:
    out = subprocess.run(["sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", job_id],
                         capture_output=True, text=True).stdout
    states = dict(line.split("|", 1) for line in out.splitlines() if "|" in line)
    return states.get(f"{job_id}+0", "")


def final_state(job_id: str, timeout_s: float) -> str:
    """The hetjob leader's state once sacct reports it ended."""
    unfinished = ("", "PENDING", "RUNNING", "REQUEUED", "COMPLETING", "PREEMPTED")
    return wait_until(lambda: (s := leader_state(job_id)) not in unfinished and s, timeout_s,
                      f"job {job_id} to end", poll_s=3)


def life_steps(output: str, life: int) -> list[int]:
    """The steps the job's output shows trained in `life` (0: before the first resume, k: after
    the k-th resume; empty if that life has not resumed yet)."""
    parts = output.split("\nresuming ")
    if len(parts) <= life:
        return []
    return [int(m) for m in re.findall(r"^step +(\d+)/", parts[life], re.M)]


def _still_running(job_id: str) -> bool:
    """False once the job ended for good (it failed: stop waiting for its steps)."""
    state = leader_state(job_id)
    if state.split(" ")[0] in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
        raise AssertionError(f"job {job_id} ended ({state}) before the interruptions")
    return True


def _failures(run_dir: Path) -> int:
    return sum(e.get("event") == "failure" for e in read_jsonl(run_dir / "lifecycle.jsonl"))


def _starts(run_dir: Path) -> int:
    return sum(e.get("event") == "start" for e in read_jsonl(run_dir / "lifecycle.jsonl"))


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process on this machine."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out[int(d.name)] = (ppid, cmd)
    return out


def trainer_processes(job_id: str, in_step: bool) -> list[int]:
    """The TrainerWorker processes of `job_id`'s Ray (a descendant of its `ray start`, whose
    command line names /tmp/rlray-JOB-NODE); `in_step`: only those running train_step."""
    procs = _processes()

    def of_job(pid: int) -> bool:
        for _ in range(20):
            if pid not in procs:
                return False
            pid, cmd = procs[pid]
            if f"rlray-{job_id}-" in cmd:
                return True
        return False
    return [pid for pid, (_, cmd) in procs.items()
            if cmd.startswith("ray::TrainerWorker") and (not in_step or "train_step" in cmd)
            and of_job(pid)]


def kill_trainer_mid_step(job_id: str) -> int:
    """SIGKILL one trainer process of `job_id`, caught in train_step if it shows within 120 s."""
    try:
        pids = wait_until(lambda: trainer_processes(job_id, in_step=True), 120,
                          "a trainer in train_step", poll_s=0.05)
    except TimeoutError:
        pids = trainer_processes(job_id, in_step=False)
    assert pids, f"no trainer process of job {job_id}"
    os.kill(pids[0], signal.SIGKILL)
    return pids[0]


def lose_node(node: str) -> list[int]:
    """Kill every process in `node`'s network namespace (its slurmd and all the job runs there),
    as a node that loses power; `slurm/testing/start.sh` starts its slurmd again."""
    pids = subprocess.run(["ip", "netns", "pids", f"rl-{node}"], capture_output=True, text=True,
                          check=True).stdout.split()
    for pid in map(int, pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return [int(p) for p in pids]


def interrupt(run_dir: Path, job_id: str, out: Path, record: dict,
              reference: subprocess.Popen) -> None:
    """Requeue `job_id` from outside after step 3; preempt it after the restart's first step;
    kill a trainer process mid-step after the next restart's first step; lose node n2 after
    the next one's."""
    try:
        wait_until(lambda: _still_running(job_id)
                   and len(read_jsonl(run_dir / "metrics.jsonl")) >= 3, RUN_TIMEOUT_S,
                   "step 3 of the first run", poll_s=0.5)
        record["requeued_at_step"] = len(read_jsonl(run_dir / "metrics.jsonl"))
        subprocess.run(["scontrol", "requeue", job_id], check=True, capture_output=True)
        wait_until(lambda: _still_running(job_id) and life_steps(job_output(run_dir), 1),
                   RUN_TIMEOUT_S, "a trained step after the first resume", poll_s=0.5)
        record["preempted_at_step"] = len(read_jsonl(run_dir / "metrics.jsonl"))
        urgent = subprocess.run(
            ["sbatch", "--parsable", "-p", "urgent", "-w", "n1", "-c", "3", "-J", "preemptor",
             "-o", str(out / "urgent.out"), "--wrap", "sleep 2"],
            check=True, capture_output=True, text=True)
        record["preemptor"] = urgent.stdout.strip()
        # A trainer process SIGKILLed in the middle of a step. The count of failures is taken
        # before the kill, so that the failure cannot come and go unseen.
        wait_until(lambda: _still_running(job_id) and life_steps(job_output(run_dir), 2),
                   RUN_TIMEOUT_S, "a trained step after the second resume", poll_s=0.5)
        before = _failures(run_dir)
        record["trainer_killed"] = kill_trainer_mid_step(job_id)
        # the steps logged when the kill landed (not before: finding a trainer in train_step may
        # take a step or two), so the resume's checkpoint is at most this step
        record["trainer_killed_at_step"] = len(read_jsonl(run_dir / "metrics.jsonl"))
        wait_until(lambda: _failures(run_dir) > before, 600, "the killed trainer's failure",
                   poll_s=0.5)
        # Node n2 lost, once the reference (which also runs on n2) is done.
        wait_until(lambda: _still_running(job_id) and life_steps(job_output(run_dir), 3),
                   RUN_TIMEOUT_S, "a trained step after the third resume", poll_s=0.5)
        reference.wait(RUN_TIMEOUT_S)
        before, starts = _failures(run_dir), _starts(run_dir)
        record["node_lost_at_step"] = len(read_jsonl(run_dir / "metrics.jsonl"))
        try:
            record["node_lost"] = lose_node("n2")
            # The driver notices through Ray (the node's actors die) and requeues; Slurm may
            # instead requeue the job first (its node stopped answering: SlurmdTimeout).
            wait_until(lambda: _failures(run_dir) > before or _starts(run_dir) > starts, 600,
                       "the lost node's failure", poll_s=0.5)
        finally:  # the node comes back whatever happened, or every later test loses it
            subprocess.run(["bash", str(REPO / "slurm" / "testing" / "start.sh")], check=True,
                           capture_output=True, timeout=600)
    except BaseException as e:  # noqa: BLE001 - reported by the test that needs it
        record["error"] = repr(e)
    finally:
        record["done"] = True


@pytest.fixture(scope="module")
def runs(slurm_cluster, tmp_path_factory, request):
    failed_before = request.session.testsfailed
    out = tmp_path_factory.mktemp("slurm_rl")
    ref_log = open(out / "reference.log", "w")
    reference = subprocess.Popen(
        _submit_cmd(out, "reference", "cluster.trainer.partition=urgent",
                    "cluster.rollout.partition=urgent", "cluster.trainer.cpus_per_node=1",
                    "cluster.rollout.cpus_per_node=1", "--wait"),
        cwd=REPO, env=_env(), stdout=ref_log, stderr=subprocess.STDOUT)
    job_ids = []
    try:
        # Two Ray clusters starting at once on 2 busy cores can miss `ray start`'s fixed 30 s
        # registration window: let the reference's Ray come up first.
        wait_until(lambda: "Ray up" in (out / "reference.log").read_text()
                   or reference.poll() is not None, 600, "the reference's Ray cluster")
        sub = subprocess.run(_submit_cmd(out, "interrupted"), cwd=REPO, env=_env(),
                             capture_output=True, text=True, timeout=300)
        assert sub.returncode == 0, sub.stdout + sub.stderr
        interrupted_dir = out / "interrupted"
        job_id = json.loads((interrupted_dir / "slurm_job.json").read_text())["job_id"]
        job_ids.append(job_id)
        record: dict = {"job_id": job_id}
        thread = threading.Thread(target=interrupt,
                                  args=(interrupted_dir, job_id, out, record, reference),
                                  daemon=True)
        thread.start()
        # Each requeued life starts within a second of its eligibility, not at the idle
        # cluster's next node ping (see kick_backfill_while_pending).
        with backfill_kicked(job_id):
            yield {"out": out, "reference": reference, "reference_log": out / "reference.log",
                   "interrupted_dir": interrupted_dir, "record": record, "job_ids": job_ids}
    finally:
        if reference.poll() is None:
            reference.terminate()
            reference.wait(30)
        ref_job = out / "reference" / "slurm_job.json"
        if ref_job.exists():
            job_ids.append(json.loads(ref_job.read_text())["job_id"])
        if job_ids:  # leave no job behind on failure (a no-op for finished ones)
            subprocess.run(["scancel", *job_ids], capture_output=True)
        if request.session.testsfailed == failed_before:  # keep Ray's node logs of a failure
            for job_id in job_ids:
                for node in NODE_IPS:
                    shutil.rmtree(f"/tmp/rlray-{job_id}-{node}", ignore_errors=True)


def _placement(run_dir: Path) -> dict[str, str]:
    """actor name -> node IP, from the last `placement:` line the driver logged."""
    lines = [ln for ln in (run_dir / "driver.log").read_text().splitlines() if "placement: " in ln]
    assert lines, "the driver logged no placement line"
    words = lines[-1].split("placement: ", 1)[1].split(" (")[0].split()
    return dict(w.split("@") for w in words)


def _ray_actor_classes(job_id: str, node: str) -> set[str]:
    """Actor classes whose workers Ray ran on `node` (from Ray's own per-node worker logs)."""
    logs = Path(f"/tmp/rlray-{job_id}-{node}/session_latest/logs")
    names = set()
    for path in list(logs.glob("worker-*.out")) + list(logs.glob("worker-*.err")):
        for line in path.read_text(errors="replace").splitlines()[:5]:
            if line.startswith(":actor_name:"):
                names.add(line.split(":actor_name:", 1)[1].strip())
    return names


@pytest.mark.timeout(RUN_TIMEOUT_S + 300)
def test_submit_wait_runs_the_loop_on_trainer_and_rollout_nodes(runs):
    reference = runs["reference"]
    rc = reference.wait(RUN_TIMEOUT_S)
    log = runs["reference_log"].read_text()
    assert rc == 0, log[-4000:]
    run_dir = runs["out"] / "reference"
    job_id = json.loads((run_dir / "slurm_job.json").read_text())["job_id"]
    assert f"submitted Slurm job {job_id}" in log and "tensorboard --logdir" in log
    assert f"step {NUM_STEPS:>4}/{NUM_STEPS}" in log  # --wait streamed the job's progress
    steps = [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, NUM_STEPS + 1))
    # Ray spanned the 3 nodes with the group labels ...
    assert (f"nodes n1={NODE_IPS['n1']} (trainer_node), n2={NODE_IPS['n2']} (trainer_node), "
            f"n3={NODE_IPS['n3']} (rollout_node)") in log
    # ... the placement groups put one trainer rank on each trainer node, the engine on n3 ...
    where = _placement(run_dir)
    assert sorted([where["trainer-0"], where["trainer-1"]]) == [NODE_IPS["n1"], NODE_IPS["n2"]]
    assert where["rollout-0"] == NODE_IPS["n3"]
    # ... and Ray's own per-node worker logs agree.
    assert _ray_actor_classes(job_id, "n1") == {"TrainerWorker"}
    assert _ray_actor_classes(job_id, "n2") == {"TrainerWorker"}
    assert _ray_actor_classes(job_id, "n3") == {"EngineHost"}
    assert final_state(job_id, 60) == "COMPLETED"


@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_requeue_preemption_crash_and_lost_node_resume_to_the_uninterrupted_metrics(runs):
    record, run_dir = runs["record"], runs["interrupted_dir"]
    job_id = record["job_id"]
    wait_until(lambda: record.get("done"), 2 * RUN_TIMEOUT_S, "the interruptions", poll_s=2)
    assert "error" not in record, record
    final = final_state(job_id, RUN_TIMEOUT_S)
    output = job_output(run_dir)
    assert final == "COMPLETED", output[-4000:]
    events = read_jsonl(run_dir / "lifecycle.jsonl")
    starts = [e for e in events if e["event"] == "start"]
    assert [e["restart_count"] for e in starts] == [0, 1, 2, 3, 4], events
    lives = [events[events.index(a) + 1: events.index(b) if b else None]
             for a, b in zip(starts, starts[1:] + [None])]
    # The preemption went through the signal path: USR2, checkpoint, our own requeue.
    stopped = [e for e in lives[1] if e["event"] == "stopped"]
    assert stopped and stopped[0]["reason"] == "SIGUSR2", lives[1]
    assert any(e["event"] == "requeued" and e["reason"] == "SIGUSR2" for e in lives[1])
    # The killed trainer and the lost node: each a failure the driver recorded, then its own
    # requeue.
    assert [e["event"] for e in lives[2]][-2:] == ["failure", "requeued"], lives[2]
    assert lives[2][-2]["error"] == "ActorDied" and lives[2][-1]["reason"] == "failure"
    # (the lost node: unless Slurm's own node-failure requeue came first)
    assert ([e["event"] for e in lives[3]][-2:] == ["failure", "requeued"]
            or not any(e["event"] == "failure" for e in lives[3])), lives[3]
    # Each restart resumed from a checkpoint written before its interruption.
    resumed = [int(line.rsplit("step ", 1)[1]) for line in output.splitlines()
               if line.startswith("resuming ")]
    assert len(resumed) == 4, resumed
    # The outside requeue came once step 3 was logged; the step then in flight (4, a checkpoint
    # step) may still have finished and saved before the SIGTERM arrived. Either way the first
    # resume is from a checkpoint the first life reached.
    reached = max(life_steps(output, 0), default=0)
    assert 2 <= resumed[0] <= min(reached, record["requeued_at_step"] + 1), (
        resumed, reached, record)
    assert resumed[1] >= max(resumed[0], record["preempted_at_step"]), (resumed, record)
    assert resumed[1] <= resumed[2] <= record["trainer_killed_at_step"], (resumed, record)
    assert resumed[2] <= resumed[3] <= record["node_lost_at_step"], (resumed, record)
    assert events[-1]["event"] == "done" and events[-1]["step"] == NUM_STEPS
    # Per-step metrics equal the uninterrupted run's, bit for bit.
    runs["reference"].wait(RUN_TIMEOUT_S)
    want = read_jsonl(runs["out"] / "reference" / "metrics.jsonl")
    got = read_jsonl(run_dir / "metrics.jsonl")
    steps = list(range(1, NUM_STEPS + 1))
    assert [m["step"] for m in got] == [m["step"] for m in want] == steps
    for g, w in zip(got, want):
        for key in COMPARED:
            if key in w:
                assert g[key] == w[key], (g["step"], key, g[key], w[key])
    # TensorBoard shows each start's restart count, and the preemption's signal (USR2 = 12).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    counts = [(e.step, e.value) for e in acc.Scalars("slurm/restart_count")]
    assert counts == [(0, 0.0)] + [(s, float(k + 1)) for k, s in enumerate(resumed)], counts
    assert acc.Scalars("slurm/requeue_signal")[2].value == 12.0
    assert [e.step for e in acc.Scalars("reward/mean")] == steps


@pytest.mark.timeout(300)
def test_status_shows_state_step_restarts_and_checkpoint(runs):
    run_dir = runs["interrupted_dir"]
    if not any(e["event"] == "done" for e in read_jsonl(run_dir / "lifecycle.jsonl")):
        pytest.skip("the interrupted run did not finish (see the test above)")
    out = subprocess.run([sys.executable, "-m", "launch.status", str(run_dir)], cwd=REPO,
                         env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    job_id = runs["record"]["job_id"]
    assert f"job:        {job_id}  state: COMPLETED" in out.stdout, out.stdout
    assert f"step:       {NUM_STEPS}" in out.stdout
    assert "restarts:   4, failures: " in out.stdout, out.stdout
    assert f"checkpoint: {run_dir / 'checkpoints' / f'step_{NUM_STEPS:06d}'}" in out.stdout

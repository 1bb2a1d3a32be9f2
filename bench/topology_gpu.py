"""The seed's topology on real GPUs (issue 17): one heterogeneous Slurm job, trainer group and
rollout group on GPU nodes of the project's real single-machine Slurm test cluster, submitted
with `python -m launch.submit` through submitit, requeued from outside in the middle, resumed.

    python -m bench.topology_gpu [--trainer-nodes 1] [--requeue-at 8] [--out DIR]
    python -m bench.topology_gpu --smoke     (CPU: the same flow on configs/slurm_cpu_test.yaml,
                                              no GRES, the running test cluster as it is)

1. Starts the test cluster (slurm/testing/start.sh) with the machine's GPUs as GRES: trainer
   nodes n1 (and n2 with --trainer-nodes 2) one GPU each, rollout node n3 the next GPU(s);
   without accounting (no MariaDB on the GPU machine; `RL_SLURM_ACCOUNTING=none`). Slurm comes
   from .debs when it is not installed (`RL_SLURM_DEBS`, slurm/testing/fetch_debs.sh).
2. Checks the GRES: one `srun` per node reports the CUDA_VISIBLE_DEVICES its task gets.
3. `reference`: configs/slurm_gpu_test.yaml with `--wait`, uninterrupted.
4. `interrupted`: the same config, submitted without --wait; once it logged --requeue-at steps,
   `scontrol requeue` (SIGTERM to every step: Ray and the workers die); the requeued job
   resumes from its last checkpoint. While it runs, `nvidia-smi` lists which process holds which
   GPU.
5. Compares the per-step metrics of both runs and reports the step split (rollout, train, sync,
   checkpoint) in `<out>/topology_gpu.{json,md}`; exits 1 when a check failed.

Ray: the GPU machine has none and its wheel is larger than what travels there, so
`bench/ray_slim.sh` builds a slim one that `bench/run_gpu.sh topology` installs. Must run as root
(namespaces, daemons).
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.common import device_info, parse_args, write_results
from job.lifecycle import read_jsonl
from slurm.testing.client import read_env_file, wait_until

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "slurm_gpu_test.yaml"
CPU_CONFIG = REPO / "configs" / "slurm_cpu_test.yaml"
COMPARED = ("reward/mean", "reward/std", "train/loss", "train/kl", "train/grad_norm",
            "train/entropy", "rollout/response_length", "eval/pass1")
PHASES = ("time/rollout", "time/reward", "time/train", "time/sync", "time/step")


def sh(*cmd: str, env: dict | None = None, timeout: float = 120) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    return proc.stdout + proc.stderr


def start_cluster(gres: str) -> dict[str, str]:
    env = dict(os.environ)
    if gres:  # the GPU machine: its own cluster, GPUs as GRES, no MariaDB there
        env.update(RL_SLURM_GPUS=gres, RL_SLURM_ACCOUNTING="none", RL_SLURM_NODE_CPUS="8",
                   RL_SLURM_NODE_MEM_MB="64000")
    debs = REPO / ".debs"
    if debs.is_dir():
        env["RL_SLURM_DEBS"] = str(debs)
    proc = subprocess.run(["bash", str(REPO / "slurm/testing/start.sh")], env=env, text=True,
                          capture_output=True, timeout=300)
    print(proc.stdout, proc.stderr, flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"start.sh failed ({proc.returncode})")
    state = Path(env.get("RL_SLURM_DIR", "/tmp/rl-slurm"))
    return {**env, **read_env_file(state / "env.sh")}


def gres_check(env: dict, layout: dict[str, list[int]]) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES of a task on each GPU node, asking for all of that node's GPUs."""
    seen = {}
    for node, ids in layout.items():
        out = sh("srun", "-p", "urgent", "-w", node, "-N1", "-n1", f"--gres=gpu:{len(ids)}",
                 "sh", "-c", "echo CVD=$CUDA_VISIBLE_DEVICES prolog=$RL_SLURM_GPUS_MAPPED",
                 env=env, timeout=60)
        print(node, out.strip(), flush=True)
        m = re.search(r"CVD=(\S*)", out)
        seen[node] = m.group(1) if m else f"? {out.strip()[-200:]}"
    return seen


def submit(config: Path, env: dict, out: Path, name: str, overrides: list[str], wait: bool,
           timeout: float) -> tuple[str, str]:
    cmd = [sys.executable, "-m", "launch.submit", str(config), f"output_dir={out}",
           f"name={name}", *overrides, "--no-resume", *(["--wait"] if wait else [])]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=REPO)
    text = proc.stdout + proc.stderr
    print(text[-3000:], flush=True)
    m = re.search(r"submitted Slurm job (\d+)", text)
    if not m or (wait and proc.returncode != 0):
        raise SystemExit(f"{name}: launch.submit failed (rc {proc.returncode})")
    return m.group(1), text


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return read_jsonl(path) if path.exists() else []


def job_log(run_dir: Path) -> str:
    job = json.loads((run_dir / "slurm_job.json").read_text())
    return "".join(Path(job[k]).read_text(errors="replace") for k in ("stdout", "stderr")
                   if Path(job[k]).exists())


def gpu_processes() -> str:
    return sh("nvidia-smi", "--query-compute-apps=pid,gpu_bus_id,used_memory",
              "--format=csv,noheader")


def summarize(name: str, run_dir: Path, wall_s: float) -> dict:
    rows = metrics(run_dir)
    log = job_log(run_dir)
    events = read_jsonl(run_dir / "lifecycle.jsonl")
    ckpt = [float(s) for s in re.findall(r"checkpoint \S+ written in ([\d.]+)s", log)]
    resumed = [int(s) for s in re.findall(r"^resuming .* step (\d+)$", log, re.M)]
    placement = re.findall(r"placement: (.*)", log)
    out = {"run": name, "steps": len(rows), "wall_s": wall_s,
           "restarts": max((e.get("restart_count", 0) for e in events), default=0),
           "resumed_from": resumed[0] if resumed else None,
           "placement": placement[-1] if placement else None,
           "checkpoint_s": statistics.median(ckpt) if ckpt else None,
           "checkpoints": len(ckpt)}
    body = rows[1:] or rows  # the first step carries CUDA-graph capture and warm-up
    for key in PHASES:
        vals = [r[key] for r in body if key in r and "eval/pass1" not in r]
        out[key.split("/")[1] + "_s"] = statistics.median(vals) if vals else None
    sync = [r for r in body if "sync/gbytes_per_s" in r]
    out["sync_MB"] = sync[0]["sync/bytes"] / 1e6 if sync else None
    out["sync_GBps"] = statistics.median(r["sync/gbytes_per_s"] for r in sync) if sync else None
    out["reward_first"] = rows[0]["reward/mean"] if rows else None
    out["reward_last"] = rows[-1]["reward/mean"] if rows else None
    out["eval_pass1"] = next((r["eval/pass1"] for r in reversed(rows) if "eval/pass1" in r),
                             None)
    return out


def compare(want: list[dict], got: list[dict]) -> list[str]:
    """Differences of the compared metrics, step by step (empty: identical)."""
    diffs = []
    if [m["step"] for m in got] != [m["step"] for m in want]:
        diffs.append(f"steps {[m['step'] for m in got]} != {[m['step'] for m in want]}")
    for g, w in zip(got, want):
        for key in COMPARED:
            if key in w and g.get(key) != w[key]:
                diffs.append(f"step {w['step']} {key}: {g.get(key)!r} != {w[key]!r}")
    return diffs


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], lambda p: (
        p.add_argument("--trainer-nodes", type=int, default=1),
        p.add_argument("--requeue-at", type=int, default=8),
        p.add_argument("--runs", default="/tmp/topology_runs"),
        p.add_argument("--timeout", type=float, default=420.0)))
    import torch
    config = CPU_CONFIG if args.smoke else CONFIG
    if args.smoke:
        args.trainer_nodes, args.requeue_at = 2, min(args.requeue_at, 3)
    nodes = ["n1", "n2"][:args.trainer_nodes] + ["n3"]
    num_gpus = torch.cuda.device_count()
    if not args.smoke and num_gpus == 0:
        raise SystemExit("no GPU found (use --smoke on a CPU machine)")
    # Fewer GPUs than nodes (a 1-GPU machine): the nodes share them, each node's GRES naming
    # the same device file; Slurm cannot tell, and the run says so.
    layout = {} if args.smoke else {n: [i % num_gpus] for i, n in enumerate(nodes)}
    shared = len(layout) > num_gpus and not args.smoke
    gres = " ".join(f"{n}={','.join(map(str, ids))}" for n, ids in layout.items())
    t0 = time.monotonic()
    env = start_cluster(gres)
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(
        p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p))
    cluster_s = time.monotonic() - t0
    visible = gres_check(env, layout)
    print("GRES check:", visible, flush=True)
    runs = Path(args.runs)
    overrides = [f"cluster.trainer.nodes={args.trainer_nodes}",
                 f"trainer.num_ranks={args.trainer_nodes}"]
    num_steps = yaml.safe_load(config.read_text())["num_steps"]

    t0 = time.monotonic()
    ref_id, _ = submit(config, env, runs, "reference", overrides, wait=True,
                       timeout=args.timeout)
    ref_wall = time.monotonic() - t0
    t0 = time.monotonic()
    job_id, _ = submit(config, env, runs, "interrupted", overrides, wait=False, timeout=300)
    run_dir = runs / "interrupted"

    def reached() -> bool:
        if not sh("squeue", "-h", "-j", job_id, env=env).strip():
            raise SystemExit(f"job {job_id} ended before step {args.requeue_at}:\n"
                             + job_log(run_dir)[-3000:])
        return len(metrics(run_dir)) >= args.requeue_at
    wait_until(reached, args.timeout, f"step {args.requeue_at}", poll_s=1)
    gpus_in_use = "" if args.smoke else gpu_processes()
    print("nvidia-smi compute apps:\n" + gpus_in_use, flush=True)
    requeued_at = len(metrics(run_dir))
    print(sh("scontrol", "requeue", job_id, env=env) or f"requeued {job_id} at step {requeued_at}",
          flush=True)
    done = lambda: any(e["event"] == "done" for e in read_jsonl(run_dir / "lifecycle.jsonl"))
    wait_until(done, args.timeout, "the requeued job to finish", poll_s=2)
    wait_until(lambda: not sh("squeue", "-h", "-j", job_id, env=env).strip(), 60,
               f"job {job_id} to leave the queue")
    wall = time.monotonic() - t0

    reference = summarize("reference (uninterrupted)", runs / "reference", ref_wall)
    interrupted = summarize(f"interrupted (scontrol requeue at step {requeued_at})", run_dir,
                            wall)
    diffs = compare(metrics(runs / "reference"), metrics(run_dir))
    interrupted["metrics_equal"] = not diffs
    reference["metrics_equal"] = None
    checks = {
        "GRES gives each node its GPU": args.smoke or (
            (shared or len(set(visible.values())) == len(layout))
            and all(visible[n] == ",".join(map(str, ids)) for n, ids in layout.items())),
        f"reference ran {num_steps} steps": reference["steps"] == num_steps,
        "interrupted was requeued once and resumed": interrupted["restarts"] == 1
        and interrupted["resumed_from"] is not None,
        f"interrupted ran {num_steps} steps": interrupted["steps"] == num_steps,
        "per-step metrics identical to the reference": not diffs,
    }
    info = {**device_info(), "cluster_start_s": cluster_s, "gres": gres, "gpus_shared": shared,
            "cuda_visible_devices": visible, "gpu_processes": gpus_in_use.splitlines(),
            "reference_job": ref_id, "interrupted_job": job_id, "checks": checks,
            "differences": diffs[:20]}
    columns = ["run", "steps", "restarts", "resumed_from", "wall_s", "rollout_s", "reward_s",
               "train_s", "sync_s", "step_s", "checkpoint_s", "sync_MB", "sync_GBps",
               "reward_first", "reward_last", "eval_pass1", "metrics_equal"]
    topology = (f"CPU smoke run of {config.name}: {args.trainer_nodes} trainer nodes, 1 "
                "rollout node, no GPUs" if args.smoke else
                f"topology: {gres} (GRES gpu; CUDA_VISIBLE_DEVICES seen by each node's task: "
                f"{visible}); trainer {args.trainer_nodes} node(s) x 1 GPU (DeepSpeed ZeRO-3, "
                "BF16), rollout 1 node x 1 GPU (native FP8 engine), FP8 weight sync over NCCL"
                + (f"; the machine has {num_gpus} GPU(s): the nodes SHARE them (both groups on "
                   "one device), so this shows the path, not the seed's GPU separation"
                   if shared else ""))
    notes = [topology,
             "placement (the job's own log): " + str(interrupted["placement"]),
             "phase times: median over steps 2..N without evaluation (time/* metrics); "
             "checkpoint_s: median of the job log's 'checkpoint ... written in' lines",
             "wall_s: from launch.submit to the job's end (reference: --wait; interrupted: "
             "including the requeue and the restart)",
             "checks: " + "; ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in checks.items())]
    if diffs:
        notes.append("first differences: " + "; ".join(diffs[:5]))
    write_results("topology_gpu" + ("_smoke" if args.smoke else ""), args.out, info,
                  [reference, interrupted], columns, notes)
    print("\n".join(notes), flush=True)
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()

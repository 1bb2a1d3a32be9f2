"""Ray inside a Slurm (het)job: plain functions the submitted function calls.

`start_ray(run_dir)` starts a Ray head on the first trainer node (het group 0) and one Ray worker
on every other node of every het group, each as its own `srun --overlap --het-group=K -N1 -n1 -w
NODE ray start ... --block` step, then connects this process (`ray.init`) and waits until every
node has joined. `stop_ray(cluster)` undoes it. Each node advertises a custom resource,
`trainer_node` (group 0) or `rollout_node` (group 1), value 1, so placement can pin actors.

Per node: its own `--temp-dir` (short: Ray's unix sockets live there), its own port block (nodes
that share an IP would collide otherwise), `--node-ip-address` = Slurm's NodeAddr, dashboard off.

Security: token authentication is always on. A fresh random token is written with mode 0600 to
`run_dir/ray_auth_token`; every Ray process gets `RAY_AUTH_MODE=token` and
`RAY_AUTH_TOKEN_PATH` pointing at it, and this process keeps them in `os.environ` so later
`ray.init` calls and the actors it creates authenticate too.

Teardown deliberately does not run `ray stop`: it kills every Ray process of the user on the
node by name (other jobs' too, and on the single-machine test cluster every "node's"). Instead a
per-node srun sends SIGTERM to that node's `ray start --block` by pid (written at start to
`run_dir/ray-NODE.pid`), which then stops the processes it started; steps that outlive a grace
period are cancelled through their srun.

Must run inside a Slurm allocation (uses SLURM_JOB_ID, SLURM_JOB_NODELIST_HET_GROUP_K).
"""
from __future__ import annotations

import json
import os
import secrets
import shlex
import socket
import subprocess
import sys
import time
import typing as tp
from dataclasses import dataclass, field
from pathlib import Path

from job.slurm_env import slurm_env
from rl.cluster.groups import ROLLOUT_NODE, TRAINER_NODE

TRAINER_RESOURCE = TRAINER_NODE  # the labels rl.cluster.groups places actors by
ROLLOUT_RESOURCE = ROLLOUT_NODE
GROUP_RESOURCES = (TRAINER_RESOURCE, ROLLOUT_RESOURCE)  # index = het group
TOKEN_FILE = "ray_auth_token"
PORTS_PER_NODE = 200  # offsets 0..9 fixed services, 100..199 worker ports
_PORT_RANGE = (20000, 60000)
_INHERITED_REQUESTS = frozenset(
    f"SLURM_{v}" for v in ("CPUS_PER_TASK", "MEM_PER_NODE", "MEM_PER_CPU", "MEM_PER_GPU",
                           "GPUS", "GPUS_PER_NODE", "GPUS_PER_TASK", "GPUS_PER_SOCKET",
                           "CPUS_PER_GPU", "TRES_PER_TASK", "NTASKS", "NPROCS",
                           "NTASKS_PER_NODE"))


class RayClusterError(RuntimeError):
    """Ray could not be started inside the allocation; the message names nodes and logs."""


@dataclass(frozen=True, kw_only=True)
class RayNode:
    """One Slurm node of the job as Ray sees it."""

    name: str
    ip: str
    group: int
    """Het group: 0 = trainer, 1 = rollout."""
    num_cpus: int
    port_base: int

    @property
    def resource(self) -> str:
        return GROUP_RESOURCES[min(self.group, len(GROUP_RESOURCES) - 1)]


@dataclass(kw_only=True)
class RayCluster:
    """A running Ray cluster: head address, nodes, and the srun steps hosting them."""

    address: str
    """`ip:port` of the head's GCS."""
    nodes: list[RayNode]
    run_dir: Path
    token_path: Path
    steps: dict[str, subprocess.Popen] = field(default_factory=dict)
    """node name -> the srun running `ray start --block` there."""


def het_group_nodes() -> list[list[str]]:
    """Node names per het group (a plain job is one group), from the Slurm environment."""
    size = int(slurm_env("het_size") or 1)
    groups = []
    for k in range(size):
        nodelist = slurm_env("nodelist_het", k)
        if nodelist is None and size == 1:
            nodelist = slurm_env("nodelist")
        if not nodelist:
            raise RayClusterError(f"SLURM_JOB_NODELIST_HET_GROUP_{k} is not set: not inside a "
                                  "Slurm allocation?")
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist],
                             check=True, capture_output=True, text=True).stdout
        groups.append(out.split())
    return groups


def node_address(name: str) -> str:
    """The IP Slurm uses for `name` (NodeAddr), resolved if it is a host name."""
    out = subprocess.run(["scontrol", "show", "node", "-o", name],
                         check=True, capture_output=True, text=True).stdout
    fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
    addr = fields.get("NodeAddr", name)
    try:
        return socket.gethostbyname(addr)
    except OSError as e:
        raise RayClusterError(f"cannot resolve NodeAddr {addr!r} of node {name}: {e}") from e


def _group_cpus(k: int) -> int:
    return int(slurm_env("cpus_per_task_het", k) or slurm_env("cpus_per_task") or 1)


def plan_nodes(groups: list[list[str]], job_id: int, cpus_per_group: list[int] | None = None,
               port_base: int | None = None) -> list[RayNode]:
    """Assigns each node its IP, CPUs and a port block; node 0 (first trainer) is the head.

    Port blocks: node i of the job uses [base + i*200, base + (i+1)*200); the job's base is
    derived from its id so two jobs on one node rarely collide.
    """
    names = [(k, n) for k, group in enumerate(groups) for n in group]
    span = PORTS_PER_NODE * len(names)
    if port_base is None:
        slots = max(1, (_PORT_RANGE[1] - _PORT_RANGE[0]) // span)
        port_base = _PORT_RANGE[0] + (job_id % slots) * span
    cpus = cpus_per_group or [_group_cpus(k) for k in range(len(groups))]
    return [RayNode(name=n, ip=node_address(n), group=k, num_cpus=cpus[k],
                    port_base=port_base + i * PORTS_PER_NODE) for i, (k, n) in enumerate(names)]


def write_token(run_dir: Path) -> Path:
    """Writes a fresh 256-bit token readable only by this user; returns its path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / TOKEN_FILE
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def auth_env(token_path: Path) -> dict[str, str]:
    """Environment that makes Ray (servers and clients) require/use the token."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}


def use_token_in_this_process(token_path: Path) -> None:
    """Makes this process (and the workers it spawns) authenticate with `token_path`.

    Ray caches the auth mode and token at import time, so the environment alone is not enough
    in a process that already imported ray; this refreshes both caches as Ray's own
    `_enable_token_auth` does.
    """
    os.environ.update(auth_env(token_path))
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]  # lint baseline (issue 39)

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def ray_start_args(node: RayNode, head: RayNode, temp_dir: Path,
                   object_store_bytes: int | None = None) -> list[str]:
    """`ray start` arguments for `node` (the head when node is head)."""
    p = node.port_base
    args = ["start", "--block", "--disable-usage-stats", f"--node-ip-address={node.ip}",
            f"--temp-dir={temp_dir}", f"--num-cpus={node.num_cpus}",
            f"--resources={json.dumps({node.resource: 1})}",
            f"--node-manager-port={p + 1}", f"--object-manager-port={p + 2}",
            f"--metrics-export-port={p + 3}", f"--dashboard-agent-listen-port={p + 4}",
            f"--dashboard-agent-grpc-port={p + 5}", f"--runtime-env-agent-port={p + 6}",
            f"--min-worker-port={p + 100}", f"--max-worker-port={p + PORTS_PER_NODE - 1}"]
    if node is head:
        args += ["--head", f"--port={p}", f"--ray-client-server-port={p + 7}",
                 "--include-dashboard=false"]
    else:
        args += [f"--address={head.ip}:{head.port_base}"]
    if object_store_bytes:
        args.append(f"--object-store-memory={object_store_bytes}")
    return args


def _step_flags(node: RayNode, cpus: int) -> list[str]:
    # --overlap: the driver's own step already holds trainer node 0's CPUs; --mem=0 and the
    # job's GPUs by default (no gres request) give the step the whole allocation on the node.
    return ["--overlap", f"--het-group={node.group}", "--nodes=1", "--ntasks=1",
            f"--nodelist={node.name}", f"--cpus-per-task={cpus}", "--mem=0"]


def _step_env(env: tp.Mapping[str, str]) -> dict[str, str]:
    # The caller's step exports ITS resource requests (het group 0's), which srun would read
    # as requests for the new step too and fail where group 1 has fewer CPUs/memory/GPUs.
    return {k: v for k, v in env.items() if k not in _INHERITED_REQUESTS}


def private_dir_sh(path: Path) -> str:
    """Shell that makes `path` a directory only this user can use, or exits 1 saying why: made
    0700 if absent; if present, it must be a directory this user owns, not a symlink (else
    someone who made it first in the node's shared /tmp could read or replace Ray's session
    files and sockets)."""
    d = shlex.quote(str(path))
    return (f"if [ -L {d} ] || {{ [ -e {d} ] && ! {{ [ -d {d} ] && [ -O {d} ]; }}; }}; then "
            f"echo \"refusing Ray temp dir {d}: a symlink, not a directory, or not yours\" >&2; "
            f"exit 1; fi; mkdir -p -m 700 {d} && chmod 700 {d} || exit 1")


def _launch(node: RayNode, args: list[str], run_dir: Path, env: dict[str, str],
            temp_dir: Path) -> subprocess.Popen:
    # Ray's CLI through this interpreter: an install without console scripts beside it (pip
    # --target, as on the GPU machine) has no `ray` executable there.
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]
    pid_file = run_dir / f"ray-{node.name}.pid"
    pid_file.unlink(missing_ok=True)
    # The pid lets stop_ray end exactly this process. Slurm sends the job's warning signal
    # (USR1/USR2) to every step: Ray must survive it so the driver can still checkpoint;
    # SIG_IGN is inherited by every Ray process. The temp dir is made on the node itself.
    inner = (f"{private_dir_sh(temp_dir)}; echo $$ > {shlex.quote(str(pid_file))}; "
             "trap '' USR1 USR2; exec \"$0\" \"$@\"")
    cmd = ["srun", *_step_flags(node, node.num_cpus), f"--job-name=ray-{node.name}",
           "--kill-on-bad-exit=0", "sh", "-c", inner, *ray_cli, *args]
    with open(run_dir / f"ray-{node.name}.log", "ab") as log:
        # own session: the driver's terminal signals must not reach the steps directly
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_step_env(env),
                                start_new_session=True)


def wait_for_port(ip: str, port: int, proc: subprocess.Popen, deadline: float, what: str,
                  log: Path) -> None:
    """Blocks until `ip:port` accepts connections; raises early if `proc` (its server) exits."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RayClusterError(f"{what} exited with {proc.returncode} before listening on "
                                  f"{ip}:{port}; log {log}:\n{_tail(log)}")
        try:
            with socket.create_connection((ip, port), timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    raise RayClusterError(f"{what} not listening on {ip}:{port} in time; log {log}:\n{_tail(log)}")


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def start_ray(run_dir: str | Path, *, timeout_s: float = 120.0,
              cpus_per_group: list[int] | None = None, object_store_bytes: int | None = None,
              temp_root: str | Path = "/tmp", port_base: int | None = None) -> RayCluster:
    """Starts Ray on every node of the allocation, connects this process, waits for all nodes.

    Args:
        run_dir: shared directory of this run: token file, one `ray-NODE.log` per node.
        timeout_s: for the head to listen plus all nodes to join.
        cpus_per_group: Ray CPUs per node of each het group (default: the group's
            SLURM_CPUS_PER_TASK_HET_GROUP_K).
        temp_root: local directory for Ray's per-node temp dirs (keep it short: unix sockets).

    Raises:
        RayClusterError naming the nodes that did not join (and their logs).
    """
    import ray  # noqa: F401  (fails here, before any node starts, where Ray is missing)

    run_dir = Path(run_dir).absolute()
    job_id_text = slurm_env("job_id")
    if job_id_text is None:
        raise RayClusterError("SLURM_JOB_ID is not set: not inside a Slurm allocation?")
    job_id = int(job_id_text)
    nodes = plan_nodes(het_group_nodes(), job_id, cpus_per_group, port_base)
    head = nodes[0]
    token_path = write_token(run_dir)
    use_token_in_this_process(token_path)
    env = dict(os.environ)
    cluster = RayCluster(address=f"{head.ip}:{head.port_base}", nodes=nodes, run_dir=run_dir,
                         token_path=token_path)
    deadline = time.monotonic() + timeout_s
    try:
        def temp(n: RayNode) -> Path:
            return Path(temp_root) / f"rlray-{job_id}-{n.name}"

        cluster.steps[head.name] = _launch(
            head, ray_start_args(head, head, temp(head), object_store_bytes), run_dir, env,
            temp(head))
        wait_for_port(head.ip, head.port_base, cluster.steps[head.name], deadline,
                      f"Ray head on {head.name}", run_dir / f"ray-{head.name}.log")
        for n in nodes[1:]:
            cluster.steps[n.name] = _launch(
                n, ray_start_args(n, head, temp(n), object_store_bytes), run_dir, env, temp(n))
        connect(cluster)
        wait_for_nodes(cluster, deadline)
    except BaseException:
        stop_ray(cluster)
        raise
    return cluster


def connect(cluster: RayCluster) -> None:
    """Connects this process to the head. A head that listens but whose GCS never answers (its
    raylet timed out starting on a busy node: "The current node timed out during startup") makes
    `ray.init` raise ConnectionError; that becomes a RayClusterError naming the head's log, which
    `slurm.allocation._start_ray` tries once more from scratch like a node that did not join."""
    import ray

    head = cluster.nodes[0]
    log = cluster.run_dir / f"ray-{head.name}.log"
    try:
        ray.init(address=cluster.address, logging_level="WARNING")
    except (ConnectionError, TimeoutError) as e:
        if ray.is_initialized():
            ray.shutdown()
        first = str(e).splitlines()[0] if str(e) else ""
        raise RayClusterError(f"Ray head on {head.name} listened on {cluster.address} but did "
                              f"not answer ({type(e).__name__}: {first}); log {log}:\n"
                              f"{_tail(log)}") from e


def wait_for_nodes(cluster: RayCluster, deadline: float) -> None:
    """Blocks until Ray lists every node of `cluster` alive (by IP), or raises naming the rest."""
    import ray

    while True:
        alive = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
        missing = [n for n in cluster.nodes if n.ip not in alive]
        if not missing:
            return
        dead = [n for n in missing
                if n.name in cluster.steps and cluster.steps[n.name].poll() is not None]
        if dead or time.monotonic() > deadline:
            why = "their srun exited" if dead else "timed out"
            details = "\n".join(f"--- {n.name} ({n.ip}) log {cluster.run_dir}/ray-{n.name}.log:\n"
                                f"{_tail(cluster.run_dir / f'ray-{n.name}.log', 8)}"
                                for n in (dead or missing))
            raise RayClusterError(
                f"Ray nodes missing ({why}): {', '.join(f'{n.name} ({n.ip})' for n in missing)}"
                f"\n{details}")
        time.sleep(0.5)


def stop_ray(cluster: RayCluster | None, grace_s: float = 20.0) -> None:
    """Disconnects this process and stops Ray on every node, gracefully where possible (`None`:
    Ray did not start; only this process is disconnected).

    Per node, a short srun step sends SIGTERM to that node's `ray start --block` by pid (it
    then stops the Ray processes it started). Steps still running after `grace_s` are ended
    through their srun (SIGTERM: Slurm kills the step and every process in it).
    """
    import ray

    if ray.is_initialized():
        ray.shutdown()
    if cluster is None:
        return
    running = [n for n in cluster.nodes
               if n.name in cluster.steps and cluster.steps[n.name].poll() is None]
    stoppers = []
    for n in running:
        pid_file = cluster.run_dir / f"ray-{n.name}.pid"
        if pid_file.exists():
            stoppers.append(subprocess.Popen(
                ["srun", *_step_flags(n, 1), f"--job-name=ray-stop-{n.name}",
                 "kill", "-TERM", pid_file.read_text().strip()],
                env=_step_env(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    deadline = time.monotonic() + grace_s
    for p in stoppers:
        _wait_or(p, deadline, p.kill)
    for n in running:
        step = cluster.steps[n.name]
        _wait_or(step, deadline, step.terminate)  # srun: TERM means "cancel the step"
        _wait_or(step, time.monotonic() + 10, step.kill)


def _wait_or(proc: subprocess.Popen, deadline: float, fallback) -> None:
    try:
        proc.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        fallback()
        proc.wait()

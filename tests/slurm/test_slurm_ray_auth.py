"""Ray token authentication as `slurm.ray_cluster` configures it, on a local (non-Slurm) head.

A head started with the per-job token must refuse clients without it (auth disabled on the
client, or a wrong token) and accept a client that has it. The same head serves the check that
`wait_for_nodes` names the nodes that never joined.
"""
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from slurm.ray_cluster import (PORTS_PER_NODE, RayNode, auth_env, ray_start_args, wait_for_port,
                               write_token)

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _free_port_block(size: int = PORTS_PER_NODE) -> int:
    """A base port whose first 8 ports are free now (Ray's fixed services use base..base+7)."""
    for base in range(41000 + os.getpid() % 50 * size, 60000, size):
        try:
            for p in range(base, base + 8):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port block")


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def _connect(address: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return _run(f"""
        import ray
        ray.init(address={address!r}, logging_level="ERROR")
        print("CPUS", ray.cluster_resources().get("CPU"))
    """, env)


@pytest.fixture(scope="module")
def token_head(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("ray_auth")
    token = write_token(tmp_path)
    node = RayNode(name="local", ip="127.0.0.1", group=0, num_cpus=1, port_base=_free_port_block())
    temp = Path("/tmp") / f"rlray-auth-{os.getpid()}"  # short: Ray's unix sockets live here
    args = ray_start_args(node, node, temp, object_store_bytes=80 * 2**20)
    log = tmp_path / "head.log"
    head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), *args],
                            env={**os.environ, **auth_env(token)}, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_port(node.ip, node.port_base, head, time.monotonic() + 90, "local Ray head", log)
        yield f"{node.ip}:{node.port_base}", token, tmp_path
    finally:
        head.terminate()  # `ray start --block` stops the processes it started
        try:
            head.wait(30)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.timeout(240)
def test_ray_head_refuses_clients_without_the_job_token(token_head):
    address, token, tmp_path = token_head
    assert token.stat().st_mode & 0o777 == 0o600
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    base["HOME"] = str(tmp_path)  # no ~/.ray/auth_token to fall back on
    refused = {**base, "RAY_gcs_server_port_wait_time_s": "2"}  # give up after 2 tries, not 20

    no_auth = _connect(address, {**refused, "RAY_AUTH_MODE": "disabled"})
    assert no_auth.returncode != 0 and "InvalidAuthToken" in no_auth.stderr, no_auth.stderr[-2000:]

    wrong = _connect(address, {**refused, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64})
    assert wrong.returncode != 0 and "InvalidAuthToken" in wrong.stderr, wrong.stderr[-2000:]

    ok = _connect(address, {**base, **auth_env(token)})
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "CPUS 1.0" in ok.stdout


@pytest.mark.timeout(120)
def test_wait_for_nodes_names_the_missing_nodes(token_head):
    address, token, tmp_path = token_head
    out = _run(f"""
        import subprocess, time
        from pathlib import Path
        import ray
        from slurm.ray_cluster import RayCluster, RayClusterError, RayNode, wait_for_nodes
        ray.init(address={address!r}, logging_level="ERROR")
        # Ray reports a head started on 127.0.0.1 under the machine's address
        head = RayNode(name="local", ip=ray.nodes()[0]["NodeManagerAddress"], group=0,
                       num_cpus=1, port_base=0)
        ghost = RayNode(name="n9", ip="10.213.7.99", group=1, num_cpus=1, port_base=0)
        alive, dead = subprocess.Popen(["sleep", "30"]), subprocess.Popen(["true"])
        dead.wait()
        for steps in ({{"local": alive, "n9": dead}}, {{"local": alive, "n9": alive}}):
            cluster = RayCluster(address={address!r}, nodes=[head, ghost],
                                 run_dir=Path({str(tmp_path)!r}),
                                 token_path=Path({str(token)!r}), steps=steps)
            t0 = time.monotonic()
            try:
                wait_for_nodes(cluster, time.monotonic() + 3)
            except RayClusterError as e:
                print(f"ERR {{time.monotonic() - t0:.1f}}", str(e).splitlines()[0])
        alive.kill()
    """, {**os.environ, **auth_env(token)})
    assert out.returncode == 0, out.stderr[-2000:]
    errors = [line.split(" ", 2) for line in out.stdout.splitlines() if line.startswith("ERR")]
    assert [e[2] for e in errors] == [
        "Ray nodes missing (their srun exited): n9 (10.213.7.99)",
        "Ray nodes missing (timed out): n9 (10.213.7.99)"]
    assert float(errors[0][1]) < 2 and 3 <= float(errors[1][1]) < 6  # dead step: no waiting

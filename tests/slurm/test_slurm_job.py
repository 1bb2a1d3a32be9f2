"""slurm.sbatch / slurm.allocation without a cluster: the sbatch text of the target config
(golden file) and the requeue limit."""
import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from rl.config import ConfigError, load_config
from rl.signals import EXIT_ABORTED, StopRequest
from slurm.allocation import RequeueLimit, _check_requeue_limit
from slurm.sbatch import make_executor, wait_for

REPO = Path(__file__).resolve().parents[2]
DSV4 = REPO / "configs" / "deepseek_v4_flash_3node.yaml"
GOLDEN = Path(__file__).parent / "golden" / "deepseek_v4_flash_3node.sbatch"


@pytest.mark.skipif(not DSV4.exists(), reason=f"{DSV4.name} is missing")
def test_deepseek_v4_flash_3node_sbatch_text_matches_golden_file():
    cfg = load_config(DSV4, [])
    executor = make_executor(cfg, python="/opt/rl/.venv/bin/python", repo=Path("/opt/rl"))
    text = executor.submission_text()
    if os.environ.get("UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), f"regenerate with UPDATE_GOLDEN=1 if intended:\n{text}"
    # what the golden file pins, spelled out: 2 x 8 GPUs + 1 x 8 GPUs, one job, requeueable
    head, rollout = text.split("#SBATCH hetjob\n")
    assert "#SBATCH --nodes=2" in head and "#SBATCH --gpus-per-node=8" in head
    assert "#SBATCH --nodes=1" in rollout and "#SBATCH --gpus-per-node=8" in rollout
    assert f"#SBATCH --signal=USR2@{cfg.cluster.signal_before_end_s}" in head
    assert all("#SBATCH --requeue" in part for part in (head, rollout))
    assert f"--output={cfg.run_dir}/submitit/%j_0_log.out" in head
    assert "-m submitit.core._submit" in rollout.splitlines()[-1]
    # cluster.network, exported before the command so srun steps and Ray actors inherit it
    setup = rollout.split("# setup\n")[1].split("# command")[0]
    hca = cfg.cluster.network.ib_hca
    assert f"export NCCL_IB_HCA={hca}\n" in setup and "export NCCL_DEBUG=WARN\n" in setup
    assert "export NCCL_SOCKET_IFNAME='^lo,docker'\n" in setup and "GLOO_" not in setup


def test_network_keys_become_the_nccl_environment():
    from rl.config import ConfigError
    from slurm.params import network_env

    cfg = load_config(None, ["cluster.network.ib_hca=mlx5_0:1,mlx5_1:1",
                             "cluster.network.socket_ifname==bond0",
                             "cluster.network.gloo_socket_ifname=bond0",
                             "cluster.network.ib_gid_index=3", "cluster.network.ib_disable=true",
                             "cluster.network.extra_env={NCCL_NVLS_ENABLE: '0'}"])
    assert network_env(cfg.cluster.network) == {
        "NCCL_IB_HCA": "mlx5_0:1,mlx5_1:1", "NCCL_SOCKET_IFNAME": "=bond0",
        "GLOO_SOCKET_IFNAME": "bond0", "NCCL_IB_GID_INDEX": "3", "NCCL_IB_DISABLE": "1",
        "NCCL_NVLS_ENABLE": "0"}
    assert network_env(load_config(None, []).cluster.network) == {}  # NCCL's defaults
    with pytest.raises(ConfigError, match=r"cluster.network.net_gdr_level: got 'NEAR'"):
        load_config(None, ["cluster.network.net_gdr_level=NEAR"])
    with pytest.raises(ConfigError, match=r"cluster.network.gloo_socket_ifname: got '\^lo'"):
        load_config(None, ["cluster.network.gloo_socket_ifname=^lo"])
    with pytest.raises(ConfigError, match=r"cluster.network.extra_env: got \['PATH'\]"):
        load_config(None, ["cluster.network.extra_env={PATH: /x}"])


def test_stop_past_max_requeues_ends_with_a_clear_error(tmp_path):
    cfg = load_config(REPO / "configs" / "slurm_cpu_test.yaml",
                      [f"output_dir={tmp_path}", "cluster.max_requeues=2"])
    stop = StopRequest()
    stop.request("SIGUSR2")
    with pytest.raises(RequeueLimit, match=r"already requeued 2 times \(cluster.max_requeues=2\)"):
        _check_requeue_limit(cfg, stop, "77", restarts=2, why="stopped on SIGUSR2 at step 4")
    events = [json.loads(x) for x in (cfg.run_dir / "lifecycle.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "requeue_limit" and events[-1]["reason"] == "SIGUSR2"


class _FinishedJob:
    """What `wait_for` reads of a submitit job whose result is already pickled."""

    def __init__(self, tmp_path: Path, result: dict):
        self.job_id, self.state, self._result = "42", "COMPLETED", result
        self.paths = SimpleNamespace(stdout=tmp_path / "out", stderr=tmp_path / "err",
                                     result_pickle=tmp_path / "result.pkl")
        self.paths.stdout.write_text("step 1/2 ...\n")
        self.paths.result_pickle.write_bytes(b"")

    def result(self) -> dict:
        return self._result


@pytest.mark.parametrize("status, code", [("done", 0), ("aborted", EXIT_ABORTED)])
def test_wait_returns_the_runs_exit_status(tmp_path, status, code, capsys):
    sigint = signal.getsignal(signal.SIGINT)
    try:
        got = wait_for(_FinishedJob(tmp_path, {"status": status, "step": 2, "run_dir": "r"}))
    finally:
        signal.signal(signal.SIGINT, sigint)
    assert got == code
    assert ("aborted at step 2" in capsys.readouterr().err) == (status == "aborted")


def _slurm_failures(monkeypatch, tmp_path, restarts: int, ray_error, **over):
    """`slurm_main` whose Ray start fails with `ray_error` in life `restarts`; returns (its
    outcome or the requeue it asked for, the lifecycle events)."""
    import slurm.allocation as allocation
    cfg = load_config(REPO / "configs" / "slurm_cpu_test.yaml",
                      [f"output_dir={tmp_path}", *(f"{k}={v}" for k, v in over.items())])
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", str(restarts))
    monkeypatch.setattr(allocation, "_start_ray", lambda cfg: (_ for _ in ()).throw(ray_error))
    stopped = []
    monkeypatch.setattr(allocation, "stop_ray", stopped.append)
    requeued = []

    def requeue_self(job_id, restarts, limit, why):
        requeued.append((job_id, restarts, limit, why))
        raise SystemExit(75)
    monkeypatch.setattr(allocation, "requeue_self", requeue_self)
    try:
        out = allocation.slurm_main(cfg)
    except SystemExit as e:
        out = e.code
    from job.rundir import RunDirLock
    RunDirLock._held[str(cfg.run_dir.resolve())].release()  # as the life's end would
    events = [json.loads(x) for x in (cfg.run_dir / "lifecycle.jsonl").read_text().splitlines()]
    return out, requeued, stopped, events


def test_a_failure_requeues_the_job_and_a_crash_loop_ends_it(monkeypatch, tmp_path):
    from slurm.ray_cluster import RayClusterError
    out, requeued, stopped, events = _slurm_failures(
        monkeypatch, tmp_path, 0, RayClusterError("n2 did not join"))
    assert out == 75 and stopped == [None]
    assert requeued == [("77", 0, 5, "the run failed (RayClusterError: n2 did not join)")]
    assert [e["event"] for e in events] == ["failure", "requeued"]
    assert events[1]["reason"] == "failure" and events[0]["checkpoint_step"] is None
    for life in (1, 2):
        out, requeued, _, events = _slurm_failures(
            monkeypatch, tmp_path, life, RayClusterError("n2 did not join"))
    assert out["status"] == "crash_loop" and not requeued
    assert "3 failures in a row without a new checkpoint" in out["message"]
    assert events[-1]["event"] == "crash_loop"


def test_a_config_error_in_the_job_is_raised_not_requeued(monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match="bad key"):
        _slurm_failures(monkeypatch, tmp_path, 0, ConfigError("bad key"))

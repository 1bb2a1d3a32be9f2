"""The test cluster's configuration with GPUs (issue 17), without starting it: what
slurm/testing/write_config.sh writes for RL_SLURM_GPUS / RL_SLURM_ACCOUNTING, and how the
TaskProlog maps Slurm's per-node GPU positions to the machine's device numbers. (The cluster
itself ran with these files on the GPU machine: bench/topology_gpu.py.)"""
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTING = REPO / "slurm" / "testing"


def write_config(tmp_path: Path, **env: str) -> Path:
    state = tmp_path / "state"
    script = (f"set -euo pipefail; source {TESTING}/config.sh; mkdir -p \"$ETC\"; "
              f"source {TESTING}/write_config.sh")
    subprocess.run(["bash", "-c", script], check=True, capture_output=True, text=True,
                   env={"PATH": "/usr/bin:/bin", "RL_SLURM_DIR": str(state), **env})
    return state / "etc"


def node_lines(slurm_conf: str) -> dict[str, str]:
    return {line.split()[0].split("=")[1]: line for line in slurm_conf.splitlines()
            if line.startswith("NodeName=")}


def test_gpus_become_gres_of_their_nodes_with_a_task_prolog(tmp_path):
    etc = write_config(tmp_path, RL_SLURM_GPUS="n1=0 n3=1,2", RL_SLURM_ACCOUNTING="none")
    conf = (etc / "slurm.conf").read_text()
    nodes = node_lines(conf)
    assert " Gres=gpu:1 " in nodes["n1"] and "Gres" not in nodes["n2"]
    assert " Gres=gpu:2 " in nodes["n3"]
    assert "GresTypes=gpu" in conf and f"TaskProlog={etc}/task_prolog.sh" in conf
    assert (etc / "gres.conf").read_text().splitlines() == [
        "NodeName=n1 Name=gpu File=/dev/nvidia0", "NodeName=n3 Name=gpu File=/dev/nvidia1",
        "NodeName=n3 Name=gpu File=/dev/nvidia2"]
    assert "AccountingStorageType=accounting_storage/none" in conf
    assert "slurmdbd" not in conf


def test_default_has_no_gres_and_keeps_accounting(tmp_path):
    etc = write_config(tmp_path)
    conf = (etc / "slurm.conf").read_text()
    assert "Gres" not in conf and "TaskProlog" not in conf
    assert (etc / "gres.conf").read_text() == ""
    assert "AccountingStorageType=accounting_storage/slurmdbd" in conf


def prolog(etc: Path, node: str, visible: str) -> str:
    return subprocess.run(["sh", str(etc / "task_prolog.sh")], capture_output=True, text=True,
                          check=True, env={"PATH": "/usr/bin:/bin", "SLURMD_NODENAME": node,
                                           "CUDA_VISIBLE_DEVICES": visible}).stdout


def test_task_prolog_maps_node_positions_to_device_numbers(tmp_path):
    etc = write_config(tmp_path, RL_SLURM_GPUS="n1=0 n3=1,2", RL_SLURM_ACCOUNTING="none")
    # Slurm 22.05 without cgroups hands n3's only allocated GPU (/dev/nvidia1) over as "0"
    assert "export CUDA_VISIBLE_DEVICES=1\n" in prolog(etc, "n3", "0")
    assert "export CUDA_VISIBLE_DEVICES=2,1\n" in prolog(etc, "n3", "1,0")
    assert "export CUDA_VISIBLE_DEVICES=0\n" in prolog(etc, "n1", "0")
    assert prolog(etc, "n2", "0") == ""   # a node without GPUs: left alone
    assert prolog(etc, "n3", "5") == ""   # a position the node does not have: left alone
    assert prolog(etc, "n3", "") == ""


def test_a_pid_file_counts_only_for_the_daemon_it_is_named_after(tmp_path):
    """A daemon killed without removing its pid file leaves a pid the kernel reuses (pid_max is
    often 32,768): start.sh once skipped slurmctld because a test's process had its old pid."""
    proc = subprocess.Popen(["sleep", "60"])
    try:
        def alive(name: str) -> bool:
            (tmp_path / f"{name}.pid").write_text(f"{proc.pid}\n")
            script = f"source {TESTING}/config.sh; pid_alive {tmp_path}/{name}.pid"
            return subprocess.run(["bash", "-c", script], env={"PATH": "/usr/bin:/bin"}).returncode == 0
        assert alive("sleep") and alive("sleep-n1")  # RUN/slurmd-n1.pid names slurmd
        assert not alive("slurmctld") and not alive("slurmd-n2") and not alive("munged")
    finally:
        proc.kill()
        proc.wait()
    assert not alive("sleep")  # gone

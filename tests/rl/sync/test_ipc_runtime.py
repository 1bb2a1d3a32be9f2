"""The same-device weight sync inside the runtime, on CPU: DeepSpeed trainer rank 0 and a native
engine in two plain processes, `sync.backend: ipc` (the path `auto` takes on one GPU, where the
staging slots are CUDA memory instead of /dev/shm). After the sync the engine scores as the
trainer does. Its GPU twin: tests/gpu/test_colocated_gpu.py."""
import pytest

from tests.helpers.colocated import one_step_on_one_device

pytestmark = pytest.mark.slow


def test_trainer_and_engine_on_one_device_sync_over_ipc(tmp_path):
    pytest.importorskip("deepspeed")
    r = one_step_on_one_device(tmp_path, "cpu", "ipc", "float32", zero_stage=2)
    assert r["transport"] == "ipc"
    assert r["versions"] == [1] and r["versions_again"] == [2]
    assert r["sample_versions_again"] == [2]
    assert r["trainer_moved"] > 0.01                          # the step changed the policy
    assert r["engine_vs_trainer_before_sync"] > 0.01
    assert r["engine_vs_trainer_after_sync"] < 1e-4           # fp32 on both sides
    assert r["sync"]["bytes"] > 0 and r["sync_again"]["bytes"] == r["sync"]["bytes"]

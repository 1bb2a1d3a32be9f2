"""A weight sync that fails part-way is a `SyncError` at the driver on both actor backends (plain
processes and Ray) and both transports between processes of one host (gloo, ipc), whether the
sender notices or the driver's own deadline runs out: the one type the recovery path
(`rl.publisher`) catches. Real processes, real transports."""
import os
from pathlib import Path

import pytest

from rl.cluster.actors import ProcActor, RayActor, RemoteError, wait_all
from rl.cluster.groups import free_port
from rl.sync.group import wait_for_sync
from rl.sync.transport import SyncError
from tests.rl.sync.sync_workers import Receiver, Sender

ROOT = Path(__file__).resolve().parents[3]
ENV = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def ray_started():
    import ray
    if ray.is_initialized():  # the loop tests' session Ray: share it
        yield
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir="/tmp/rl-ray-tests",
             runtime_env={"env_vars": ENV}, logging_level="ERROR")
    yield
    ray.shutdown()


def start(backend, request):
    """A sender and a receiver actor on `backend`; killed after the test."""
    if backend == "proc":
        actors = [ProcActor(cls, name=cls.__name__.lower(), env=ENV) for cls in (Sender, Receiver)]
        wait_all([a.ready for a in actors])
    else:
        request.getfixturevalue("ray_started")
        import ray
        actors = [RayActor(ray.remote(num_cpus=0)(cls).remote(), cls.__name__.lower())
                  for cls in (Sender, Receiver)]
    for a in actors:
        request.addfinalizer(a.kill)
    wait_all([a.call("pid") for a in actors])  # both built: the deadline below is the sync's own
    return actors


BACKENDS = ["proc", pytest.param("ray", marks=pytest.mark.slow)]
TRANSPORTS = ["gloo", "ipc"]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_receiver_that_dies_mid_bucket_is_a_sync_error(backend, transport, request):
    sender, receiver = start(backend, request)
    # The pair works: a whole update arrives, every bucket of it.
    port = free_port()
    stats, count = wait_for_sync([sender.call("send", port, 6, 20.0, transport),
                                  receiver.call("receive", port, 6, 20.0, backend=transport)],
                                 timeout_s=60)
    assert count == 6 and stats["bytes"] == 6 * 64 * 64 * 4
    port = free_port()
    futures = [sender.call("send", port, 7, 20.0, transport),
               receiver.call("receive", port, 7, 20.0, stop_after=2, how="exit",
                             backend=transport)]
    with pytest.raises(SyncError, match="weight sync .*bucket") as err:
        wait_for_sync(futures, timeout_s=60)
    if backend == "proc":  # the worker's traceback travels along, as the cause
        assert isinstance(err.value.__cause__, RemoteError)
        assert "sender: Traceback" in str(err.value.__cause__)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_receiver_stuck_mid_bucket_hits_the_driver_deadline_as_a_sync_error(backend, transport,
                                                                           request):
    sender, receiver = start(backend, request)
    port = free_port()
    # The group's own timeout (60 s) is far away: only the driver's deadline can end this.
    futures = [sender.call("send", port, 7, 60.0, transport),
               receiver.call("receive", port, 7, 60.0, stop_after=2, how="hang",
                             backend=transport)]
    with pytest.raises(SyncError, match="not every trainer rank and engine finished within 3s"):
        wait_for_sync(futures, timeout_s=3)



def test_ipc_between_two_processes_delivers_every_update_bit_for_bit(request):
    """The same-device transport end to end between two real processes (on a CPU: /dev/shm; the
    GPU's CUDA IPC differs only in how the staging slots are shared): 3 updates over one group,
    6 buckets each, so both staging slots are reused; then a group with checksums. Nothing is
    left in /dev/shm."""
    sender, receiver = start("proc", request)
    for version, verify, rounds in ((1, False, 3), (4, True, 2)):
        port = free_port()
        stats, ok = wait_for_sync(
            [sender.call("send", port, version, 20.0, "ipc", verify, rounds),
             receiver.call("receive_all", port, version, 20.0, "ipc", verify, rounds)],
            timeout_s=60)
        assert ok == [True] * rounds and stats["bytes"] == 6 * 64 * 64 * 4
    pids = {a.call("pid").result() for a in (sender, receiver)}
    if os.path.isdir("/dev/shm"):
        assert not [f for f in os.listdir("/dev/shm")
                    if any(f.startswith(f"rl-sync-{pid}-") for pid in pids)]

"""The rendezvous stores listen on the job's address only, not on every interface (torch's
default), and a value planted in the ipc transport's store cannot make a peer run code."""
import datetime
import pickle
import socket

import pytest
import torch

import rl.sync.ipc as ipc
from rl.cluster.groups import free_port, tcp_store
from rl.sync.transport import SyncError, rendezvous


def _other_local_address() -> str | None:
    """An address of this machine other than loopback (the one other machines reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: only picks the outgoing interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


@pytest.mark.parametrize("make", ["tcp_store", "rendezvous"])
def test_a_store_on_loopback_is_not_reachable_on_other_interfaces(make):
    other = _other_local_address()
    if other is None:
        pytest.skip("this machine has no address besides loopback")
    port = free_port()
    if make == "tcp_store":  # what the trainer ranks' DeepSpeed rendezvous uses
        store = tcp_store("127.0.0.1", port, 1, True, datetime.timedelta(seconds=10))
    else:  # the weight-sync group's
        store = rendezvous("127.0.0.1", port, 1, 0, 10)
    store.set("k", "v")
    assert _reachable("127.0.0.1", port)
    assert not _reachable(other, port)  # torch's own server would accept this connection
    client = torch.distributed.TCPStore("127.0.0.1", port, 1, False,
                                        datetime.timedelta(seconds=10))
    assert client.get("k") == b"v"


def test_a_store_bound_to_the_nodes_address_serves_its_clients():
    other = _other_local_address()
    if other is None:
        pytest.skip("this machine has no address besides loopback")
    port = free_port()
    store = tcp_store(other, port, 1, True, datetime.timedelta(seconds=10))
    store.set("k", "v")
    assert not _reachable("127.0.0.1", port)
    assert torch.distributed.TCPStore(other, port, 1, False,
                                      datetime.timedelta(seconds=10)).get("k") == b"v"


class Planted:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os
        return (os.makedirs, (self.marker,))


def test_a_planted_value_in_the_ipc_store_is_refused_before_it_runs(tmp_path):
    port = free_port()
    store = rendezvous("127.0.0.1", port, 1, 0, 10)
    group = ipc.IpcGroup(store, 1, 2, torch.device("cpu"), 5.0, {})
    store.set("where", pickle.dumps({"host": "h", "device": "cpu", "pid": Planted(tmp_path / "x")}))
    with pytest.raises(SyncError, match="a value in the store is not the protocol's .*os.makedirs"
                                        " is not part of the weight-sync protocol"):
        group._get("where", "the handshake")
    assert not (tmp_path / "x").exists()


def test_what_the_protocol_sends_passes_the_allowlist():
    """The handshake, a CPU header and the shape of a CUDA IPC handle (reduce_tensor's args:
    tensor and storage classes, size, dtype, handle bytes), which the GPU path sends."""
    cuda_like = (torch.Tensor, torch.Size([4, 2]), (2, 1), 0, torch.storage.TypedStorage,
                 torch.bfloat16, 0, b"\x01handle", 16, 0, False, b"ref", 0, b"event", True)
    values = [{"host": "h/boot", "device": "cpu", "pid": 7}, {"pid": 8, "error": None},
              (3, 2, 100, True, "abc", [("/dev/shm/rl-sync-1-x", 64)] * 2),
              (3, 2, 100, False, "abc", [cuda_like, cuda_like])]
    for value in values:
        assert ipc._loads(pickle.dumps(value)) == value

"""The same-device transport (`rl.sync.ipc`, `sync.backend: ipc`) in one process, sender and
receiver in two threads over /dev/shm: the checks every transport owes (layout, version,
checksums, a clear error on every failure) and its own (handshake, staging reuse, cleanup). The
two-process end to end is in test_sync_failures.py."""
import os
import subprocess
import threading
import time

import pytest
import torch

import rl.sync.ipc as ipc
from rl.cluster.groups import free_port
from rl.sync.buckets import pack_bucket, plan_for
from rl.sync.transport import SyncError, make_group, receive_buckets, send_buckets

BUCKET = 128  # 3 buckets: a staging slot is reused within one update


@pytest.fixture(autouse=True)
def no_files_left():
    """Whatever happened, the sender's /dev/shm staging files are gone after the test."""
    yield
    if os.path.isdir("/dev/shm"):
        assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"rl-sync-{os.getpid()}-")]


def tensors(scale: int = 1):
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 5, generator=g), "b": torch.arange(7, dtype=torch.int64),
            "c": torch.randn(100 * scale, generator=g).to(torch.bfloat16),
            "d": torch.randn(40, 40 * scale, generator=g)}


def exchange(updates, receiver_verify=None, timeout_s=20.0):
    """`updates`: [(tensors, version sent, version expected, verify)], sent over one ipc group.
    Returns (what the receiver got per update, receiver errors, sender errors, sender stats)."""
    port = free_port()
    got, r_err, s_err, stats = [], [], [], []

    def receiver():
        try:
            g = make_group("127.0.0.1", port, 2, 1, "ipc", timeout_s=timeout_s)
            for t, _, expected, verify in updates:
                plan = plan_for(t.items(), bucket_bytes=BUCKET)
                v = verify if receiver_verify is None else receiver_verify
                got.append({k: x.clone() for items in receive_buckets(g, plan, expected, v)
                            for k, x in items})
        except Exception as e:  # noqa: BLE001
            r_err.append(e)

    th = threading.Thread(target=receiver, name="receiver")
    th.start()
    try:
        g = make_group("127.0.0.1", port, 2, 0, "ipc", timeout_s=timeout_s)
        for t, sent, _, verify in updates:
            plan = plan_for(t.items(), bucket_bytes=BUCKET)
            stats.append(send_buckets(g, plan, sent, lambda _i, b, t=t: pack_bucket(b, t),
                                      verify=verify))
        keys = g.store.num_keys()
        stats.append(keys)
    except SyncError as e:
        s_err.append(e)
    th.join(30)
    assert not th.is_alive()
    return got, r_err, s_err, stats


def test_updates_arrive_bit_for_bit_and_the_store_does_not_grow():
    t = tensors()
    updates = [({k: v + i for k, v in t.items()}, i, i, i % 2 == 1) for i in range(4)]
    got, r_err, s_err, stats = exchange(updates)
    assert not r_err and not s_err
    for (want, *_), have in zip(updates, got):
        assert have.keys() == want.keys() and all(torch.equal(have[k], want[k]) for k in want)
    assert stats[0]["bytes"] == sum(x.numel() * x.element_size() for x in t.values())
    assert stats[-1] <= 4  # handshake keys only: each update deletes its own


def test_a_larger_plan_gets_new_staging_slots():
    small, large = tensors(), tensors(scale=3)
    got, r_err, s_err, _ = exchange([(small, 1, 1, True), (large, 2, 2, True), (small, 3, 3, True)])
    assert not r_err and not s_err
    assert all(torch.equal(got[1][k], large[k]) for k in large)
    assert all(torch.equal(got[2][k], small[k]) for k in small)


def test_version_mismatch_fails_both_sides():
    _, r_err, s_err, _ = exchange([(tensors(), 4, 5, False)])
    assert [str(e) for e in r_err] == ["weight sync version mismatch: sender sent 4, expected 5"]
    assert len(s_err) == 1 and "aborted" in str(s_err[0]) and "version mismatch" in str(s_err[0])


def test_verify_on_one_side_only_is_refused():
    _, r_err, s_err, _ = exchange([(tensors(), 1, 1, False)], receiver_verify=True)
    assert "sync.verify differs between the sender (False) and this engine (True)" in str(r_err[0])
    assert s_err


def test_checksum_mismatch_names_the_bucket(monkeypatch):
    """The sender's checksum of bucket 1 does not match its bytes (what a bucket changed after
    the sender's checksum looks like to the receiver): the receiver refuses it, loads nothing of
    it, and the sender learns why."""
    digest, calls = ipc.digest, []

    def wrong_on_bucket_1(buf):
        d = digest(buf)
        if threading.current_thread().name != "receiver":
            calls.append(1)
            if len(calls) == 2:
                d[0] ^= 0xFF
        return d
    monkeypatch.setattr(ipc, "digest", wrong_on_bucket_1)
    t = tensors()
    plan = plan_for(t.items(), bucket_bytes=BUCKET)
    got, r_err, s_err, _ = exchange([(t, 1, 1, True)])
    assert [str(e) for e in r_err] == [
        f"weight sync checksum mismatch in bucket 1 (first tensor {plan.buckets[1].slots[0].name}, "
        f"{plan.buckets[1].nbytes} bytes)"]
    assert got == [] and "checksum mismatch in bucket 1" in str(s_err[0])


def test_handshake_refuses_another_host(monkeypatch):
    monkeypatch.setattr(ipc, "host_id", lambda: threading.current_thread().name)
    _, r_err, s_err, _ = exchange([(tensors(), 1, 1, False)])
    for errors in (r_err, s_err):
        assert "needs trainer rank 0 and every engine on one device of one host" in str(errors[0])
        assert "set sync.backend=auto" in str(errors[0])


def test_a_receiver_whose_sender_is_gone_gets_a_sync_error():
    port = free_port()
    errors = []

    def receiver():
        try:
            g = make_group("127.0.0.1", port, 2, 1, "ipc", timeout_s=20)
            list(receive_buckets(g, plan_for(tensors().items(), BUCKET), 1))
        except SyncError as e:
            errors.append(e)

    th = threading.Thread(target=receiver, name="receiver")
    th.start()
    make_group("127.0.0.1", port, 2, 0, "ipc", timeout_s=20).close()  # its store goes with it
    th.join(30)
    assert not th.is_alive() and "lost its store while waiting for the header" in str(errors[0])


def test_rendezvous_timeout_is_a_clear_error():
    with pytest.raises(SyncError, match="rendezvous .* failed for rank 1/2 within 1s"):
        make_group("127.0.0.1", free_port(), 2, 1, "ipc", timeout_s=1)


def test_alive_tells_a_running_process_from_a_finished_one():
    assert ipc.alive(os.getpid())
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while ipc.alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not ipc.alive(child.pid)  # exited, not yet reaped (a zombie): gone all the same
    child.wait()
    assert not ipc.alive(child.pid)


def test_an_empty_plan_still_completes_on_both_sides():
    got, r_err, s_err, stats = exchange([({}, 1, 1, False), (tensors(), 2, 2, True)])
    assert not r_err and not s_err and got[0] == {} and stats[0]["bytes"] == 0
    assert all(torch.equal(got[1][k], v) for k, v in tensors().items())

import threading

import pytest
import torch

from rl.cluster.groups import free_port
from rl.sync.buckets import make_plan, pack_bucket, plan_for, unpack_bucket
from rl.sync.transport import SyncError, make_group, receive_buckets, send_buckets


def tensors():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 5, generator=g), "b": torch.arange(7, dtype=torch.int64),
            "c": torch.randn(100, generator=g).to(torch.bfloat16), "d": torch.randn(40, 40, generator=g)}


def test_plan_respects_bucket_size_and_alignment():
    t = tensors()
    plan = plan_for(t.items(), bucket_bytes=256)
    assert plan.total_bytes == sum(x.numel() * x.element_size() for x in t.values())
    # d (6400 bytes) is larger than a bucket: it gets one of its own.
    assert any(len(b.slots) == 1 and b.slots[0].name == "d" for b in plan.buckets)
    for b in plan.buckets:
        assert all(s.offset % 16 == 0 for s in b.slots)
        assert len(b.slots) == 1 or b.nbytes <= 256


def test_pack_unpack_roundtrip_is_bitwise():
    t = tensors()
    plan = plan_for(t.items(), bucket_bytes=1024)
    for b in plan.buckets:
        for name, x in unpack_bucket(b, pack_bucket(b, t)):
            assert x.dtype == t[name].dtype and torch.equal(x, t[name])


def test_pack_rejects_shape_mismatch():
    plan = make_plan([("a", (2, 2), torch.float32)], 1024)
    with pytest.raises(ValueError, match="sync plan mismatch for a"):
        pack_bucket(plan.buckets[0], {"a": torch.zeros(3)})


class _FlipOnArrival:
    """The receiver's process group, except that one byte of its `nth` broadcast is flipped once
    the data has arrived: corruption on the wire, after the sender computed its checksum."""

    def __init__(self, pg, nth: int):
        self.pg, self.nth, self.count = pg, nth, 0

    def broadcast(self, tensors, opts):
        work = self.pg.broadcast(tensors, opts)
        self.count += 1
        return _FlippingWork(work, tensors[0]) if self.count == self.nth else work


class _FlippingWork:
    def __init__(self, work, tensor):
        self.work, self.tensor = work, tensor

    def wait(self, timeout=None):
        done = self.work.wait(timeout)
        self.tensor[0] ^= 0xFF
        return done


def _exchange(verify, corrupt=False, version_sent=5, version_expected=5):
    t = tensors()
    plan = plan_for(t.items(), bucket_bytes=512)
    port = free_port()
    got, errors = {}, []

    def receiver():
        try:
            g = make_group("127.0.0.1", port, 2, 1, "gloo", timeout_s=20)
            if corrupt:  # bucket 1's data: broadcast 4 with checksums (header, b0, sum0, b1), else 3
                g.pg = _FlipOnArrival(g.pg, nth=4 if verify else 3)
            for items in receive_buckets(g, plan, version=version_expected, verify=verify):
                got.update({k: v.clone() for k, v in items})
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    th = threading.Thread(target=receiver)
    th.start()
    g = make_group("127.0.0.1", port, 2, 0, "gloo", timeout_s=20)
    stats = None
    try:
        stats = send_buckets(g, plan, version_sent, lambda _i, b: pack_bucket(b, t), verify=verify)
    except SyncError as e:
        errors.append(e)
    th.join(30)
    return t, got, errors, stats, plan


def test_broadcast_delivers_equal_weights_with_checksums():
    t, got, errors, stats, _ = _exchange(verify=True)
    assert not errors
    assert set(got) == set(t) and all(torch.equal(got[k], t[k]) for k in t)
    assert stats["bytes"] == sum(x.numel() * x.element_size() for x in t.values()) and stats["seconds"] > 0


def test_version_mismatch_fails_loudly():
    _, _, errors, _, _ = _exchange(verify=False, version_sent=4, version_expected=5)
    assert any("version mismatch: sender sent 4, expected 5" in str(e) for e in errors)


def test_verify_catches_a_bucket_corrupted_in_transit():
    t, got, errors, _, plan = _exchange(verify=True, corrupt=True)
    first = plan.buckets[1].slots[0].name
    assert [str(e) for e in errors] == [
        f"weight sync checksum mismatch in bucket 1 (first tensor {first}, "
        f"{plan.buckets[1].nbytes} bytes)"]
    # Bucket 0 was loaded; nothing of the corrupted bucket or after it was handed on.
    assert set(got) == {s.name for s in plan.buckets[0].slots}


def test_without_verify_the_same_corruption_goes_unnoticed():
    t, got, errors, _, plan = _exchange(verify=False, corrupt=True)
    assert not errors and set(got) == set(t)
    corrupted = plan.buckets[1].slots[0].name
    assert not torch.equal(got[corrupted], t[corrupted])  # what sync.verify is there to catch
    assert all(torch.equal(got[k], t[k]) for k in t if k != corrupted)


def test_rendezvous_timeout_is_a_clear_error():
    with pytest.raises(SyncError, match="rendezvous .* failed for rank 1/2 within 1s"):
        make_group("127.0.0.1", free_port(), 2, 1, "gloo", timeout_s=1)


def test_fp8_pairs_never_straddle_buckets():
    specs = []
    for i in range(6):
        specs += [(f"w{i}", (40, 16), torch.uint8), (f"w{i}_scale_inv", (1, 1), torch.float32),
                  (f"n{i}", (8,), torch.float32)]
    plan = make_plan(specs, bucket_bytes=700)
    for b in plan.buckets:
        names = [s.name for s in b.slots]
        for n in names:
            if n.endswith("_scale_inv"):
                assert n.removesuffix("_scale_inv") in names
    assert len(plan.buckets) > 2 and plan.num_tensors == len(specs)


def test_auto_sync_backend_follows_the_receiving_device():
    from rl.sync.transport import resolve_backend
    assert [resolve_backend("auto", d) for d in ("cpu", "cuda", "cuda:1")] == ["gloo", "nccl", "nccl"]
    assert resolve_backend("gloo", "cuda:0") == "gloo"

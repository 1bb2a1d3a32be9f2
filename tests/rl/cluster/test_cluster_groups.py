"""The placement layout: which Ray strategy each group gets, and the node labels it asks for."""
import pytest

from rl.cluster.groups import make_layout, spread_strategy


def test_one_actor_per_node_spreads_strictly_else_packs():
    assert spread_strategy(2, 2) == "STRICT_SPREAD"
    assert spread_strategy(16, 2) == "PACK"  # 8 GPU ranks per node: consecutive ranks together
    assert spread_strategy(2, 1) == "PACK"   # local Ray: one node
    assert spread_strategy(1, 1) == "PACK"


def test_layout_labels_groups_and_spreads_trainers_over_trainer_nodes():
    trainer, rollout = make_layout(2, 1, 0, 0, trainer_nodes=2, rollout_nodes=1)
    assert trainer.bundle == {"CPU": 1.0, "trainer_node": 0.001}
    assert rollout.bundle == {"CPU": 1.0, "rollout_node": 0.001}
    assert (trainer.strategy, rollout.strategy) == ("STRICT_SPREAD", "PACK")
    gpu_trainer, gpu_rollout = make_layout(16, 1, 1, 8, trainer_nodes=2, rollout_nodes=1)
    assert gpu_trainer.strategy == "PACK" and gpu_trainer.bundle["GPU"] == 1
    assert gpu_rollout.bundle["GPU"] == 8


def test_local_layout_is_unchanged():
    trainer, rollout = make_layout(2, 1, 0, 0)
    assert trainer.strategy == rollout.strategy == "PACK"


def test_rendezvous_ports_come_from_outside_the_ephemeral_range():
    """free_port's port is bound later (TCPStore): it must not come from the range bind(0) and
    outgoing connections draw from, where Ray's and gRPC's sockets can take it first."""
    import socket

    from rl.cluster.groups import _ephemeral_range, free_port

    lo, hi = _ephemeral_range()
    ports = {free_port() for _ in range(20)}
    if 65535 - max(hi + 1, 60001) < 256:
        pytest.skip(f"ephemeral range {lo}-{hi} leaves no room above it: free_port uses bind(0)")
    assert all(p > hi and p > 60000 for p in ports), (sorted(ports), (lo, hi))
    assert len(ports) > 1                          # drawn, not one fixed port
    for p in ports:                                # and free
        with socket.socket() as s:
            s.bind(("", p))

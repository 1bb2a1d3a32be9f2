"""The placement layout: which Ray strategy each group gets, and the node labels it asks for."""
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

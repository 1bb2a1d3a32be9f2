"""Trainer checkpoints restore every rank's own RNG streams, and the LR schedule's horizon.

Under ZeRO 0-2 DeepSpeed writes its client state from rank 0 only; a rank that restored its RNG
from there got rank 0's streams (ZeRO-3 writes one per rank). Two real DeepSpeed ZeRO-2 ranks
(plain processes, gloo) save; two fresh ranks with another seed load the checkpoint and must hold
exactly what each rank saved.
"""
import pytest

from rl.cluster.actors import ProcActor, wait_all
from rl.cluster.groups import free_port
from rl.config import AlgorithmConfig, ModelConfig, SyncConfig, TrainerConfig
from rl.models.loading import resolve_model_dir
from rl.trainer.worker import RankInfo, TrainerWorker

pytestmark = pytest.mark.slow


def _ranks(model_dir, zero_stage: int, seed: int, name: str,
           total_steps: int = 10) -> list[ProcActor]:
    cfg = TrainerConfig(num_ranks=2, zero_stage=zero_stage, lr=1e-3, lr_schedule="cosine")
    port = free_port()
    actors = [ProcActor(TrainerWorker, cfg, AlgorithmConfig(), SyncConfig(), str(model_dir),
                        "float32", RankInfo(rank=r, world_size=2, master_addr="127.0.0.1",
                                            master_port=port), seed, total_steps,
                        name=f"{name}{r}")
              for r in range(2)]
    try:
        wait_all([a.ready for a in actors], timeout=600)
    except BaseException:
        for a in actors:
            a.close()
        raise
    return actors


def _comparable(state: dict) -> tuple:
    """The RNG streams as plain values (numpy's key array and torch's byte tensor as lists)."""
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    return (state["python"], (kind, keys.tolist(), pos, has_gauss, gauss),
            state["torch"].tolist())


@pytest.mark.parametrize("zero_stage", [2])
def test_every_rank_restores_the_rng_state_it_saved(tmp_path, zero_stage):
    model_dir = resolve_model_dir(ModelConfig(preset="tiny-qwen3-moe"), tmp_path / "models")
    ckpt = str(tmp_path / "trainer")
    savers = _ranks(model_dir, zero_stage, seed=0, name="save")
    try:
        raw = wait_all([a.call("get_rng_state") for a in savers])
        saved = [_comparable(s) for s in raw]
        wait_all([a.call("save", ckpt, "ds", {"step": 1}) for a in savers], timeout=300)
    finally:
        for a in savers:
            a.close()
    assert saved[0] != saved[1]  # per-rank streams (seeded seed * 1000 + rank)
    # The loaders are a resume with twice the num_steps: the LR schedule keeps its horizon.
    loaders = _ranks(model_dir, zero_stage, seed=1, name="load", total_steps=20)
    try:
        before = [_comparable(s) for s in wait_all([a.call("get_rng_state") for a in loaders])]
        stretched = wait_all([a.call("lr_factor", 10) for a in loaders])
        clients = wait_all([a.call("load", ckpt, "ds") for a in loaders], timeout=300)
        kept = wait_all([a.call("lr_factor", s) for a in loaders for s in (5, 10, 15)])
        after = [_comparable(s) for s in wait_all([a.call("get_rng_state") for a in loaders])]
        # A checkpoint from before the per-rank files kept the RNG in DeepSpeed's client state
        # (rank 0's copy under ZeRO 0-2): it still loads, from there.
        legacy = tmp_path / "legacy"
        wait_all([a.call("save", str(legacy), "ds", {"rng": raw[0]}) for a in loaders],
                 timeout=300)
        for f in (legacy / "ds").glob("rng_rank_*.pt"):
            f.unlink()
        wait_all([a.call("load", str(legacy), "ds") for a in loaders], timeout=300)
        from_legacy = [_comparable(s) for s in wait_all([a.call("get_rng_state") for a in loaders])]
    finally:
        for a in loaders:
            a.close()
    assert before[1] != saved[1]  # the load has something to restore
    assert clients[1]["step"] == 1
    # cosine over 10 steps: halfway at 5, the floor (min_lr_ratio) from 10 on
    assert stretched == [pytest.approx(0.55)] * 2
    assert kept == [pytest.approx(x) for x in (0.55, 0.1, 0.1)] * 2
    assert after[0] == saved[0]
    assert after[1] == saved[1], "rank 1 restored another rank's RNG state"
    assert from_legacy == [saved[0], saved[0]]

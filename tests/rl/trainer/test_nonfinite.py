"""A non-finite optimizer step is skipped on every rank: weights, Adam state and LR schedule stay as
if the step never happened (two real DeepSpeed ranks, ZeRO-0 and ZeRO-3, NaN injected on rank 0)."""
import pytest
import torch

from rl.cluster.actors import ProcActor, wait_all
from rl.cluster.groups import free_port
from rl.config import AlgorithmConfig, ModelConfig, SyncConfig, TrainerConfig
from rl.faults import FAULT_NAN_STEP
from rl.models.loading import resolve_model_dir
from rl.trainer.worker import RankInfo, TrainerWorker
from tests.rl.trainer.test_worker import make_batch

pytestmark = pytest.mark.slow

NAN_STEP = 7


@pytest.fixture(scope="module", params=[0, 3], ids=["zero0", "zero3"])
def ranks(request, tmp_path_factory):
    model_dir = resolve_model_dir(ModelConfig(preset="tiny-qwen3-moe"),
                                  tmp_path_factory.mktemp("models"))
    # Warmup makes the LR move every step: a skipped step must not advance it.
    cfg = TrainerConfig(num_ranks=2, zero_stage=request.param, lr=1e-3, micro_batch_tokens=48,
                        num_mini_batches=2, warmup_steps=10)
    port = free_port()
    actors = [ProcActor(TrainerWorker, cfg, AlgorithmConfig(kl_coef=0.0), SyncConfig(),
                        str(model_dir), "float32",
                        RankInfo(rank=r, world_size=2, master_addr="127.0.0.1", master_port=port),
                        0, 20, name=f"rank{r}", env={FAULT_NAN_STEP: str(NAN_STEP)})
              for r in range(2)]
    wait_all([a.ready for a in actors], timeout=900)
    yield actors
    for a in actors:
        a.close()


def weights(ranks) -> dict[str, torch.Tensor]:
    return wait_all([a.call("full_state_dict") for a in ranks])[0]


def train(ranks, batch, step) -> dict:
    stats = [r.metrics for r in wait_all([a.call("train_step", batch, step) for a in ranks])]
    assert stats[0]["train/skipped"] == stats[1]["train/skipped"]  # the ranks agree
    return stats[0]


def test_nan_step_is_skipped_and_leaves_no_trace(ranks, tmp_path):
    first = train(ranks, make_batch(seed=1), 1)
    assert first["train/skipped"] == 0
    wait_all([a.call("save", str(tmp_path), "before") for a in ranks])
    before = weights(ranks)

    bad = train(ranks, make_batch(seed=2), NAN_STEP)  # NaN loss (and gradients) on rank 0 only
    assert bad["train/skipped"] == 2  # both mini-batches, on both ranks (stats are rank-agreed)
    assert bad["train/lr"] == first["train/lr"]  # the LR scheduler did not step
    after = weights(ranks)
    assert all(torch.equal(before[k], after[k]) for k in before), "a skipped step changed weights"

    # The next step starts from clean gradients: it equals the same step taken right after the
    # checkpoint written before the NaN step (same weights, Adam state and LR).
    good = train(ranks, make_batch(seed=3), 8)
    assert good["train/skipped"] == 0
    with_skip = weights(ranks)
    assert all(torch.isfinite(v).all() for v in with_skip.values())
    assert any(not torch.equal(with_skip[k], after[k]) for k in after)
    wait_all([a.call("load", str(tmp_path), "before") for a in ranks])
    again = train(ranks, make_batch(seed=3), 8)
    assert again["train/lr"] == good["train/lr"]
    without = weights(ranks)
    assert all(torch.equal(with_skip[k], without[k]) for k in with_skip)

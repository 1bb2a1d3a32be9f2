import pytest

from rl.rollout.base import Sample
from rl.trainer.batch import TrainBatch
from rl.trainer.microbatch import micro_batches


def batch(n=5) -> TrainBatch:
    return TrainBatch(prompt_ids=[[1, 2]] * n, response_ids=[[3] * (i + 1) for i in range(n)],
                      rollout_logprobs=[[-1.0] * (i + 1) for i in range(n)],
                      advantages=[float(i) for i in range(n)])


def test_from_samples_keeps_order_and_fields():
    samples = [Sample(prompt_ids=[1], response_ids=[5, 6], text="x", logprobs=[-0.5, -0.25],
                      finish_reason="stop", weight_version=0, version_spans=[(0, 0)]),
               Sample(prompt_ids=[2], response_ids=[7], text="y", logprobs=[-2.0],
                      finish_reason="length", weight_version=0, version_spans=[(0, 0)])]
    b = TrainBatch.from_samples(samples, [1.0, -1.0])
    assert b.prompt_ids == [[1], [2]] and b.response_ids == [[5, 6], [7]]
    assert b.rollout_logprobs == [[-0.5, -0.25], [-2.0]] and b.advantages == [1.0, -1.0]
    assert len(b) == 2 and b.lengths() == [3, 2]


def test_misaligned_fields_are_rejected():
    with pytest.raises(ValueError, match="4 advantages for 5 prompts"):
        TrainBatch(prompt_ids=[[1]] * 5, response_ids=[[2]] * 5, rollout_logprobs=[[0.0]] * 5,
                   advantages=[0.0] * 4)
    with pytest.raises(ValueError, match="sample 1 has 2 rollout_logprobs for 1 response tokens"):
        TrainBatch(prompt_ids=[[1]] * 2, response_ids=[[2]] * 2,
                   rollout_logprobs=[[0.0], [0.0, 0.0]], advantages=[0.0] * 2)


def test_micro_batches_cover_this_ranks_samples():
    b = batch(5)
    rank0 = micro_batches(b, [0, 2, 4], budget=100, world_size=2)
    rank1 = micro_batches(b, [1, 3], budget=100, world_size=2)
    assert [i for mb in rank0 for i in mb.index] == [0, 2, 4]
    assert [i for mb in rank1 for i in mb.index] == [1, 3]
    assert len(rank0) == len(rank1)  # same number of collectives on every rank

"""Bounded-staleness bookkeeping of `rl.pipeline`: versions, staleness, drops, checkpoint state.

The pipeline itself runs end to end in tests/rl/loop/test_async.py (real engines and trainer);
these check the pieces that decide what is trained on.
"""
import pytest
import torch

from rl.config import ConfigError, load_config
from rl.metrics.trajectories import TrajectoryReader, TrajectoryWriter
from rl.pipeline import RolloutBatch, resume_seed, rollout_seed, stale_groups, staleness
from rl.rollout.base import Sample


def _sample(version: int, spans=(), n_tokens: int = 4) -> Sample:
    return Sample(prompt_ids=[1, 2], response_ids=list(range(10, 10 + n_tokens)), text="x",
                  logprobs=[-0.5] * n_tokens, finish_reason="stop", weight_version=version,
                  version_spans=list(spans))


def test_oldest_version_and_spans():
    assert _sample(4).oldest_version == 4 and _sample(4).spans() == [(0, 4)]
    resumed = _sample(5, spans=[(0, 4), (3, 5)])
    assert resumed.oldest_version == 4 and resumed.spans() == [(0, 4), (3, 5)]


def test_staleness_counts_versions_behind_the_trainer():
    samples = [_sample(3), _sample(5, spans=[(0, 4), (2, 5)]), _sample(5)]
    assert staleness(samples, trainer_version=5) == [2, 1, 0]


def test_stale_groups_drops_whole_groups_past_the_bound():
    groups = [[_sample(5), _sample(5)], [_sample(5), _sample(3)], [_sample(4), _sample(4)]]
    assert stale_groups(groups, trainer_version=5, bound=1) == [False, True, False]
    assert stale_groups(groups, trainer_version=5, bound=2) == [False, False, False]
    assert stale_groups(groups, trainer_version=5, bound=0) == [False, True, True]


def test_batch_state_round_trips_through_torch_save(tmp_path):
    batch = RolloutBatch(step=7, indices=[3, 1], seconds=0.25, ahead=True,
                         groups=[[_sample(2), _sample(3, spans=[(0, 2), (3, 3)])], [_sample(2)]])
    torch.save({"pending": [batch.to_state()]}, tmp_path / "driver.pt")
    back = RolloutBatch.from_state(torch.load(tmp_path / "driver.pt")["pending"][0])
    assert back == batch
    assert back.groups[0][1].version_spans == [(0, 2), (3, 3)]
    assert back.samples()[1].oldest_version == 2


def test_seed_streams_are_pure_and_distinct():
    assert rollout_seed(0, 5) == rollout_seed(0, 5)
    seeds = {rollout_seed(0, s) for s in range(1, 200)} | {resume_seed(0, s) for s in range(1, 200)}
    assert len(seeds) == 398


def test_trajectories_record_version_spans_and_staleness(tmp_path):
    w = TrajectoryWriter(tmp_path / "t.h5")
    samples = [_sample(3, spans=[(0, 2), (3, 3)]), _sample(3)]
    w.append(step=4, weight_version=[s.weight_version for s in samples], prompt_index=[0, 0],
             prompt_ids=[s.prompt_ids for s in samples],
             response_ids=[s.response_ids for s in samples],
             rollout_logprobs=[s.logprobs for s in samples], reward=[1.0, 0.0], advantage=[1, -1],
             finish_reason=["stop", "stop"], version_spans=[s.spans() for s in samples],
             staleness=[2, 1])
    with TrajectoryReader(tmp_path / "t.h5") as r:
        assert r.row(0)["version_spans"].tolist() == [[0, 2], [3, 3]]
        assert r.row(1)["version_spans"].tolist() == [[0, 3]]
        assert r.column("staleness").tolist() == [2, 1]


@pytest.mark.parametrize("override, key", [
    ("algorithm.max_staleness=-1", "max_staleness"),
    ("algorithm.partial_rollouts=abort", "partial_rollouts"),
    ("algorithm.partial_tokens=0", "partial_tokens"),
    ("algorithm.stale_samples=reweight", "stale_samples"),
])
def test_bad_async_settings_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config("configs/local.yaml", [override])


def test_partial_tokens_must_leave_tokens_to_resume():
    with pytest.raises(ConfigError, match=r"algorithm\.partial_tokens: got 8, expected null or a "
                                          r"value < rollout\.max_new_tokens \(8\)"):
        load_config("configs/local.yaml", ["algorithm.partial_tokens=8"])
    cfg = load_config("configs/local.yaml", ["algorithm.max_staleness=2",
                                             "algorithm.partial_tokens=4"])
    assert cfg.algorithm.max_staleness == 2 and cfg.algorithm.partial_tokens == 4

"""The optional `routing` column of trajectories.h5 (logging.save_routing)."""
import numpy as np
import pytest

from rl.config import AlgorithmConfig, Config, LoggingConfig
from rl.metrics.trajectories import TrajectoryReader, TrajectoryWriter


def _batch(step, routing):
    return dict(step=step, weight_version=step, prompt_index=[0, 1], prompt_ids=[[1, 2], [1, 3, 4]],
                response_ids=[[5, 6], [7]], rollout_logprobs=[[-1.0, -2.0], [-0.5]],
                reward=[1.0, 0.0], advantage=[0.5, -0.5], finish_reason=["stop", "length"],
                routing=routing)


def test_routing_round_trips_and_truncates(tmp_path):
    path = tmp_path / "t.h5"
    w = TrajectoryWriter(path)
    w.append(**_batch(1, None))  # before routing was on: rows stay aligned, empty
    r = [np.arange(3 * 2 * 2, dtype=np.uint8).reshape(3, 2, 2), np.full((3, 2, 2), 7, np.uint8)]
    w.append(**_batch(2, r))
    w.append(**_batch(3, r))
    with TrajectoryReader(path) as reader:
        assert reader.row(0)["routing"].shape == (0, 2, 2)
        assert np.array_equal(reader.row(2)["routing"], r[0])
        assert reader.row(3)["routing"].dtype == np.uint8
    assert w.truncate(2) == 2
    with TrajectoryReader(path) as reader:
        assert reader.num_rows == 4 and np.array_equal(reader.row(3)["routing"], r[1])


def test_save_routing_needs_r3():
    with pytest.raises(ValueError, match="logging.save_routing"):
        Config(logging=LoggingConfig(save_routing=True))
    cfg = Config(logging=LoggingConfig(save_routing=True), algorithm=AlgorithmConfig(
        routing_replay="r3"))
    assert cfg.algorithm.routing_replay == "r3"
    assert AlgorithmConfig(routing_replay=False).routing_replay == "off"  # YAML's bare `off`

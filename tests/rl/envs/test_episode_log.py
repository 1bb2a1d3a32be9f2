"""The trajectory file's multi-turn columns and `launch.inspect`'s view of them."""
import pytest

from launch.inspect import main
from rl.metrics.trajectories import TrajectoryReader, TrajectoryWriter

TURNS = [{"start": 0, "end": 3, "tool_calls": [["calc", "47*38"]], "observation": "[result: 1786]"},
         {"start": 5, "end": 7, "tool_calls": [], "observation": None}]


def append(w, step, episodes=True):
    kw = dict(loss_mask=[[1, 1, 1, 0, 0, 1, 1], [1, 1]],
              episodes=[{"turns": TURNS, "error": None},
                        {"turns": TURNS[1:], "error": "TimeoutError: hung"}]) if episodes else {}
    w.append(step=step, weight_version=step - 1, prompt_index=[4, 4],
             prompt_ids=[[1, 2], [1, 2]], response_ids=[[3, 4, 5, 6, 7, 8, 2], [9, 2]],
             rollout_logprobs=[[-1.0] * 7, [-1.0] * 2], reward=[1.0, 0.0],
             advantage=[0.5, -0.5], finish_reason=["stop", "stop"], **kw)


def test_episode_columns_round_trip_and_backfill(tmp_path):
    path = tmp_path / "trajectories.h5"
    w = TrajectoryWriter(path)
    append(w, 1, episodes=False)  # rows written before the first episode (none in a real run)
    append(w, 2)
    with TrajectoryReader(path) as r:
        assert r.row(0)["episode"] is None and len(r.row(0)["loss_mask"]) == 0
        row = r.row(2)
        assert row["loss_mask"].tolist() == [1, 1, 1, 0, 0, 1, 1]
        assert row["episode"] == {"turns": TURNS, "error": None}
        assert r.row(3)["episode"]["error"] == "TimeoutError: hung"
    assert w.truncate(1) == 2
    with TrajectoryReader(path) as r:
        assert r.num_rows == 2 and r.row(1)["episode"] is None
    with pytest.raises(ValueError, match="loss_mask\\[0\\] has 3 values"):
        w.append(step=3, weight_version=2, prompt_index=[0], prompt_ids=[[1]],
                 response_ids=[[2, 3]], rollout_logprobs=[[0.0, 0.0]], reward=[0.0],
                 advantage=[0.0], finish_reason=["stop"], loss_mask=[[1, 1, 1]],
                 episodes=[None])


def test_inspect_shows_turns_tool_calls_and_observations(tmp_path, capsys):
    w = TrajectoryWriter(tmp_path / "trajectories.h5")
    append(w, 1)
    assert main([str(tmp_path), "--samples", "2", "--ids"]) == 0
    out = capsys.readouterr().out
    assert "episode:  2 turns, 2 environment tokens (masked)" in out
    assert "turn 1:   ids 3 4 5" in out and "tool call: calc('47*38')" in out
    assert "observation: '[result: 1786]'" in out and "turn 2:   ids 8 2" in out
    assert "environment failed: TimeoutError: hung" in out

"""`logging.print_every`: the driver's step line every N steps, plus evaluation steps and the
last one; every step still reaches metrics.jsonl."""
import json

from rl.config import load_config
from rl.metrics.tensorboard import MetricsLogger
from rl.rewards import RewardBreakdown
from rl.run_state import RunContext


def test_step_lines_every_n_steps_with_eval_and_last_steps(tmp_path, capsys):
    ctx = RunContext.__new__(RunContext)  # record() needs only these attributes, not a run
    ctx.cfg = load_config(None, ["logging.print_every=3", "num_steps=7"])
    ctx.run_dir, ctx.trajectories = tmp_path, None
    ctx.metrics = MetricsLogger(tmp_path, enabled=False)
    parts = RewardBreakdown(total=[], correctness=[], format=[], failed=[])
    for step in range(1, 8):
        metrics = {"reward/mean": 0.5, **({"eval/pass1": 0.25} if step == 5 else {})}
        ctx.record(step, metrics, [], [], parts, [])
    printed = [line.split()[1] for line in capsys.readouterr().out.splitlines()]
    assert printed == ["3/7", "5/7", "6/7", "7/7"]
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == list(range(1, 8))

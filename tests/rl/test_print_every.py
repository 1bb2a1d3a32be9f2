"""`logging.print_every`: the driver's step line every N steps, plus evaluation steps and the
last one; every step still reaches metrics.jsonl."""
import json

from rl.config import load_config
from rl.metrics.sinks import MetricFanOut
from rl.metrics.tensorboard import MetricsLogger
from rl.recorder import Recorder


def test_step_lines_every_n_steps_with_eval_and_last_steps(tmp_path, capsys):
    cfg = load_config(None, ["logging.print_every=3", "num_steps=7", f"output_dir={tmp_path}",
                             "name=run"])
    cfg.run_dir.mkdir()
    recorder = Recorder(cfg)
    recorder.metrics = MetricFanOut(MetricsLogger(tmp_path, enabled=False))
    for step in range(1, 8):
        metrics = {"reward/mean": 0.5, **({"eval/pass1": 0.25} if step == 5 else {})}
        recorder.record(step, metrics)
    printed = [line.split()[1] for line in capsys.readouterr().out.splitlines()]
    assert printed == ["3/7", "5/7", "6/7", "7/7"]
    rows = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == list(range(1, 8))

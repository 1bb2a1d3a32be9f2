"""`rl.sft.find_run_model_dir`: the model directory a run started from, found from
RUN_DIR/config.yaml for `launch.export` (a directory holding config.json) and `launch.inspect`
(any directory, else the path as named)."""
from pathlib import Path

import yaml

from launch.inspect import run_tokenizer_dir
from rl.export import run_model_dir
from rl.sft import find_run_model_dir


def _run(root: Path, model_path: str) -> Path:
    run = root / "checkpoints" / "demo"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(
        {"model": {"warm_start": False, "path": model_path, "preset": None, "seed": 0}}))
    return run


def test_relative_path_is_found_above_the_run_dir(tmp_path, monkeypatch):
    run = _run(tmp_path, "models/m")
    monkeypatch.chdir(run)  # not where the run started: found from RUN_DIR's parents
    assert find_run_model_dir(run) == (Path("models/m"), None)
    assert run_model_dir(run) is None and run_tokenizer_dir(run) == Path("models/m")
    (tmp_path / "models" / "m").mkdir(parents=True)
    # inspect takes any directory; export wants one that holds config.json
    assert run_tokenizer_dir(run) == tmp_path / "models" / "m"
    assert run_model_dir(run) is None
    (tmp_path / "models" / "m" / "config.json").write_text("{}")
    assert run_model_dir(run) == tmp_path / "models" / "m"
    assert find_run_model_dir(run, holds="config.json") == (Path("models/m"),
                                                            tmp_path / "models" / "m")


def test_absolute_path_missing_config_and_junk(tmp_path):
    absent = tmp_path / "absent"
    run = _run(tmp_path, str(absent))
    assert run_tokenizer_dir(run) == absent  # as named: inspect then says it has no tokenizer
    assert run_model_dir(run) is None
    (run / "config.yaml").write_text("model: [unclosed")
    assert find_run_model_dir(run) == (None, None)
    (run / "config.yaml").unlink()
    assert find_run_model_dir(run) == (None, None) and run_tokenizer_dir(run) is None

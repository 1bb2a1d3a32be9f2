"""`python -m launch.inspect` on a synthetic run directory (real HDF5 + TensorBoard files)."""
import subprocess
import sys
from pathlib import Path

import pytest

from launch.inspect import main
from rl.metrics import MetricsLogger, TrajectoryWriter
from rl.models.presets import preset_dir_name

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("runs") / "demo"
    w = TrajectoryWriter(run / "trajectories.h5")
    for step in range(3):
        w.append(step=step, weight_version=step, prompt_index=[step, step],
                 prompt_ids=[[1, 2, 3], [1, 2, 3]], response_ids=[[40 + step], [50, 51]],
                 rollout_logprobs=[[-0.1], [-0.2, -0.3]], reward=[step / 2, 0.0],
                 advantage=[0.7, -0.7], finish_reason=["stop", "length"])
    with MetricsLogger(run) as m:
        for step in (0, 2):
            m.log(step, {"eval/pass1": 0.25 + 0.25 * step})
    return run


def test_prints_summary_and_samples(run_dir, capsys):
    assert main([str(run_dir), "--samples", "2"]) == 0
    out = capsys.readouterr().out
    assert "trajectories: 6 rows, 3 steps" in out
    lines = out.splitlines()
    step2 = next(line for line in lines if line.split()[:2] == ["2", "2"])
    # step 2: rewards 1.0 and 0.0 -> mean 0.5, std 0.5; lengths 1 and 2 -> 1.5; half truncated.
    assert step2.split()[2:7] == ["0.5000", "0.5000", "1.5", "0.50", "2"]
    assert "-- row 4: step 2, weights v2" in out and "-- row 3:" not in out
    assert "response: ids 42" in out and "response: ids 50 51" in out
    assert "eval/pass1: 2 evaluations, last 0.7500 at step 2" in out


def test_plot_writes_png(run_dir, capsys):
    assert main([str(run_dir), "--samples", "0", "--plot"]) == 0
    png = run_dir / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert f"wrote {png}" in capsys.readouterr().out


def _save_word_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "one": 1, "plus": 2, "two": 3, **{f"w{i}": i for i in range(4, 60)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)


@pytest.mark.slow  # imports transformers (~10 s on 2 cores)
def test_decodes_with_run_dir_model_tokenizer(run_dir, tmp_path, capsys):
    _save_word_tokenizer(tmp_path / "tok")
    linked = tmp_path / "linked_run"
    linked.mkdir()
    (linked / "trajectories.h5").symlink_to(run_dir / "trajectories.h5")
    (linked / "model").symlink_to(tmp_path / "tok")  # RUN_DIR/model is found without --tokenizer
    assert main([str(linked), "--samples", "1"]) == 0
    out = capsys.readouterr().out
    assert "prompt:   'one plus two'" in out and "response: 'w50 w51'" in out
    # An unusable --tokenizer is reported and ids are printed instead.
    assert main([str(run_dir), "--samples", "1", "--tokenizer", str(tmp_path / "nope")]) == 0
    out = capsys.readouterr().out
    assert "no tokenizer from" in out and "response: ids 50 51" in out


@pytest.mark.slow  # imports transformers and torch (~15 s on 2 cores)
def test_decodes_with_the_runs_own_warm_start_tokenizer(run_dir, tmp_path, capsys, monkeypatch):
    """A run directory as the loop leaves it (no RUN_DIR/model): the tokenizer is the one of the
    model the run started from, found through RUN_DIR/config.yaml, whose relative paths are
    relative to where the run was started, not to where inspect runs."""
    import yaml

    from rl.config import load_config, save_config, to_dict
    from rl.sft import run_model_dir, sft_dir

    repo = tmp_path / "repo"
    run = repo / "checkpoints" / "demo"
    run.mkdir(parents=True)
    (run / "trajectories.h5").symlink_to(run_dir / "trajectories.h5")
    cfg = load_config(REPO / "configs" / "local.yaml", ["output_dir=checkpoints"])
    save_config(cfg, run / "config.yaml")
    assert not sft_dir(cfg).is_absolute()  # checkpoints/sft/tiny-qwen3-moe-<key>
    _save_word_tokenizer(repo / sft_dir(cfg))
    monkeypatch.chdir(tmp_path)  # not the directory the run started from
    assert main([str(run), "--samples", "1"]) == 0
    out = capsys.readouterr().out
    assert f"decoded with the tokenizer in {repo / sft_dir(cfg)}" in out
    assert "prompt:   'one plus two'" in out and "response: 'w50 w51'" in out
    assert main([str(run), "--samples", "1", "--ids"]) == 0
    out = capsys.readouterr().out
    assert "prompt:   ids 1 2 3" in out and "response: ids 50 51" in out and "decoded" not in out
    # Without a warm start the run started from the model itself: the preset's directory.
    plain = load_config(REPO / "configs" / "local.yaml", ["model.warm_start=false"])
    assert run_model_dir(yaml.safe_load(yaml.safe_dump(to_dict(plain)))) == \
        Path("checkpoints/models") / preset_dir_name("tiny-qwen3-moe", 0)


def test_tensorboard_only_run(tmp_path, capsys):
    with MetricsLogger(tmp_path) as m:
        m.log(0, {"eval/pass1": 0.5})
    assert main([str(tmp_path)]) == 0
    assert "trajectories: none" in capsys.readouterr().out


@pytest.mark.parametrize("make", ["missing", "empty", "junk"])
def test_bad_run_dir_exits_2_with_one_line(tmp_path, capsys, make):
    target = tmp_path / "run"
    if make != "missing":
        target.mkdir()
    if make == "junk":
        (target / "trajectories.h5").write_text("not hdf5")
    assert main([str(target)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("inspect: ")


def test_module_entry_point(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "launch.inspect", str(tmp_path / "nope")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"inspect: {tmp_path / 'nope'}: no such run directory"

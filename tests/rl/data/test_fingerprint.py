"""Data edited in place is noticed on resume: the run records its data's content at its start
(RUN_DIR/data_fingerprint.json) and a resume with other content is refused, naming the file,
unless forced. A moved file with the same bytes resumes."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rl.data.synthetic
from rl.config import ConfigError, load_config
from rl.data.example import Example
from rl.data.fingerprint import FILE, check_fingerprint, write_fingerprint
from rl.resume import check_and_save_config

ROOT = Path(__file__).resolve().parents[3]
ROWS = [json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) for i in range(20)]


def _file_run(tmp_path, train: Path, *extra):
    return load_config(None, [f"output_dir={tmp_path}", "name=r", "data.source=file",
                              f"data.train_path={train}", *extra])


def _edited(row: str) -> str:
    """`row` with its answer changed: same row count, same size."""
    answer = json.loads(row)["answer"]
    out = row.replace(f'"answer": "{answer}"', f'"answer": "{answer[:-1]}x"')
    assert out != row
    return out


def _write(path: Path, rows) -> Path:
    path.write_text("".join(r + "\n" for r in rows))
    return path


def test_a_file_edited_without_changing_its_row_count_is_refused(tmp_path):
    train = _write(tmp_path / "train.jsonl", ROWS)
    cfg = _file_run(tmp_path, train)
    cfg.run_dir.mkdir()
    check_and_save_config(cfg, resume=True, force=False)  # first start: records the data
    assert json.loads((cfg.run_dir / FILE).read_text())["data.train_path"]["path"] == str(train)
    check_and_save_config(cfg, resume=True, force=False)  # same data: resumes
    _write(train, [_edited(ROWS[0]), *ROWS[1:]])  # same rows, one answer edited
    with pytest.raises(ConfigError) as e:
        check_and_save_config(cfg, resume=True, force=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{cfg.run_dir / FILE}: refusing to resume: "
                                              f"data.train_path {train} changed since the run "
                                              "started (sha256 ")
    assert msg.endswith("pass --force to resume with the new data, or --no-resume to start over")
    assert check_fingerprint(cfg, force=True)  # forced: reported, then recorded anew
    check_and_save_config(cfg, resume=True, force=True)
    assert check_fingerprint(cfg, force=False) == []


def test_a_moved_file_with_the_same_bytes_resumes_and_an_added_eval_file_does_not(tmp_path):
    train = _write(tmp_path / "train.jsonl", ROWS)
    cfg = _file_run(tmp_path, train)
    cfg.run_dir.mkdir()
    write_fingerprint(cfg)
    moved = tmp_path / "elsewhere.jsonl"
    train.rename(moved)
    assert check_fingerprint(_file_run(tmp_path, moved), force=False) == []
    evals = _write(tmp_path / "eval.jsonl", ROWS[:3])
    with pytest.raises(ConfigError, match=f"data.eval_path added \\({evals}\\)"):
        check_fingerprint(_file_run(tmp_path, moved, f"data.eval_path={evals}"), force=False)


def test_the_synthetic_task_is_fingerprinted_by_its_rows(tmp_path, monkeypatch):
    cfg = load_config(None, [f"output_dir={tmp_path}", "name=r"])
    cfg.run_dir.mkdir()
    write_fingerprint(cfg)
    assert check_fingerprint(cfg, force=False) == []
    real = rl.data.synthetic.make_synthetic

    def other_generator(scfg, seed):  # a code change of the generator: same count, other rows
        train, evals = real(scfg, seed)
        return [Example(prompt=train[0].prompt, answer="x", meta={}), *train[1:]], evals
    monkeypatch.setattr(rl.data.synthetic, "make_synthetic", other_generator)
    with pytest.raises(ConfigError, match="data.synthetic generates other rows than when the run "
                                          "started \\(4200 -> 4200 rows"):
        check_fingerprint(cfg, force=False)


def test_a_run_without_a_fingerprint_resumes_and_records_one(tmp_path):
    train = _write(tmp_path / "train.jsonl", ROWS)
    cfg = _file_run(tmp_path, train)
    cfg.run_dir.mkdir()
    check_and_save_config(cfg, resume=True, force=False)
    (cfg.run_dir / FILE).unlink()  # as an older version left it
    _write(train, ROWS[1:])
    check_and_save_config(cfg, resume=True, force=False)
    assert (cfg.run_dir / FILE).is_file()


def test_launcher_refuses_in_one_line_before_anything_starts(tmp_path):
    train = _write(tmp_path / "train.jsonl", ROWS)
    args = [f"output_dir={tmp_path}", "name=r", "data.source=file", f"data.train_path={train}",
            "data.eval_fraction=0"]
    cfg = load_config(ROOT / "configs" / "local.yaml", args)
    cfg.run_dir.mkdir()
    check_and_save_config(cfg, resume=True, force=False)
    _write(train, [*ROWS[:-1], _edited(ROWS[-1])])
    # --dry-run: the same checks, and nothing starts should the refusal ever fail
    proc = subprocess.run([sys.executable, "-m", "launch.submit", "configs/local.yaml", *args,
                           "--dry-run"],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"data error: {cfg.run_dir / FILE}: refusing to resume: "
                           f"data.train_path {train} changed since the run started")
    assert sorted(p.name for p in cfg.run_dir.iterdir()) == ["config.yaml", FILE]

"""JSONL and Parquet loading, including the exact messages for malformed rows."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl.config import DataConfig
from rl.data import DataError, Example, build_datasets, load_examples


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_jsonl_gsm8k_rows_with_custom_keys(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [
        json.dumps({"q": "Two plus two?", "sol": "2+2=4\n#### 4", "id": 7}),
        "",  # blank lines are skipped
        json.dumps({"q": "Big?", "sol": "#### 1,000"}),
    ])
    examples = load_examples(path, prompt_key="q", answer_key="sol", answer_format="gsm8k")
    assert examples == [
        Example("Two plus two?", "4", {"id": 7, "source": f"{path}:1"}),
        Example("Big?", "1000", {"source": f"{path}:3"}),
    ]


def test_numeric_answers_become_strings(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ['{"question": "half?", "answer": 0.5}',
                                              '{"question": "n?", "answer": 3}'])
    assert [e.answer for e in load_examples(path)] == ["0.5", "3"]


@pytest.mark.parametrize("line, message", [
    ('{"question": "q", "answer": "1"', "invalid JSON (Expecting ',' delimiter at column 32); "
                                        "expected one JSON object per line"),
    ('{"question": "a line cut mid-str', "invalid JSON (Unterminated string starting at column "
                                         "14); expected one JSON object per line"),
    ('["q", "1"]', "got list ['q', '1'], expected a JSON object with keys 'question' and "
                   "'answer'"),
    ('{"question": "q"}', "missing key 'answer' (keys present: question)"),
    ('{"question": 5, "answer": "1"}', "key 'question': got 5, expected a non-empty string "
                                       "prompt"),
    ('{"question": "q", "answer": true}', "key 'answer': got True, expected a string or a number"),
    ('{"question": "q", "answer": "no marker"}',
     "key 'answer': got 'no marker', expected a GSM8K answer '... #### <answer>' "
     "(answer_format: gsm8k)"),
])
def test_malformed_jsonl_line_names_file_and_line(tmp_path, line, message):
    good = '{"question": "ok", "answer": "#### 1"}'
    path = write_jsonl(tmp_path / "bad.jsonl", [good, "", line, good])
    with pytest.raises(DataError) as err:
        load_examples(path, answer_format="gsm8k")
    assert str(err.value) == f"{path}:3: {message}"
    assert isinstance(err.value, ValueError)


def test_empty_boxed_answer_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", ['{"problem": "p", "solution": "so \\\\boxed{}"}'])
    with pytest.raises(DataError, match=r"m\.jsonl:1: key 'solution': got .*expected a MATH "
                                        r"answer containing a balanced '\\boxed\{<answer>\}'"):
        load_examples(path, prompt_key="problem", answer_key="solution", answer_format="boxed")


def test_empty_file_and_wrong_suffix(tmp_path):
    empty = write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DataError, match=r"empty\.jsonl: the file holds no examples \(empty file\)"):
        load_examples(empty)
    with pytest.raises(DataError, match=r"x\.csv: unsupported file type '\.csv', expected one of "
                                        r"\.jsonl, \.parquet"):
        load_examples(tmp_path / "x.csv")
    with pytest.raises(DataError, match=r"missing\.jsonl: no such file"):
        load_examples(tmp_path / "missing.jsonl")


def test_parquet_rows_and_row_index_in_errors(tmp_path):
    path = tmp_path / "math.parquet"
    pq.write_table(pa.table({"problem": ["p0", "p1"],
                             "solution": ["so \\boxed{\\frac{1}{2}}", "thus \\boxed{3}"]}), path)
    examples = load_examples(path, prompt_key="problem", answer_key="solution")
    assert [(e.prompt, e.answer) for e in examples] == [("p0", "\\frac{1}{2}"), ("p1", "3")]
    assert examples[1].meta == {"source": f"{path}: row 1"}

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"problem": ["p0", None], "solution": ["1", "2"]}), bad)
    with pytest.raises(DataError) as err:
        load_examples(bad, prompt_key="problem", answer_key="solution")
    assert str(err.value) == f"{bad}: row 1: key 'problem': got None, expected a non-empty " \
                             "string prompt"


def test_empty_and_corrupt_parquet(tmp_path):
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"question": pa.array([], pa.string()),
                             "answer": pa.array([], pa.string())}), empty)
    with pytest.raises(DataError, match="holds no examples"):
        load_examples(empty)
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"corrupt\.parquet: cannot read Parquet file"):
        load_examples(corrupt)


def test_build_datasets_from_files(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ['{"question": "a", "answer": "#### 1"}'])
    evals = write_jsonl(tmp_path / "eval.jsonl", ['{"question": "b", "answer": "#### 2"}'])
    cfg = DataConfig(source="file", train_path=str(train), eval_path=str(evals))
    tr, ev = build_datasets(cfg, seed=0)
    assert [(e.prompt, e.answer) for e in tr + ev] == [("a", "1"), ("b", "2")]
    tr, ev = build_datasets(DataConfig(source="file", train_path=str(train), eval_fraction=0),
                            seed=0)
    assert len(tr) == 1 and ev == []


# ---- text that is not UTF-8: a DataError naming file, line and byte, not a traceback ---------
def test_jsonl_with_bytes_that_are_not_utf8_names_file_line_and_column(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"question": "ok", "answer": "1"}\n\n'
                     + '{"question": "caf\u00e9?", "answer": "2"}\n'.encode("latin-1"))
    with pytest.raises(DataError) as err:
        load_examples(path)
    assert str(err.value) == (f"{path}:3: not UTF-8 (byte 0xe9 at column 18); expected UTF-8 "
                              "text: re-encode the file (e.g. iconv -f latin1 -t utf-8)")


def test_parquet_string_with_bytes_that_are_not_utf8_names_row_and_key(tmp_path):
    path = tmp_path / "bad.parquet"
    question = pa.array([b"fine?", b"caf\xe9?"], type=pa.binary()).view(pa.string())
    pq.write_table(pa.table({"question": question, "answer": ["1", "2"]}), path)
    with pytest.raises(DataError) as err:
        load_examples(path)
    assert str(err.value) == (f"{path}: row 1: key 'question': not UTF-8 (byte 0xe9 at column "
                              "4); expected UTF-8 text: re-encode the file (e.g. iconv -f latin1 "
                              "-t utf-8)")


def test_launcher_refuses_a_file_that_is_not_utf8_with_exit_2(tmp_path):
    """Through the command line: one line, exit 2 (was a UnicodeDecodeError traceback, exit 1)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[3]
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"question": "\xff", "answer": "1"}\n')
    proc = subprocess.run([sys.executable, "-m", "launch.submit", "configs/local.yaml",
                           f"output_dir={tmp_path}", "data.source=file",
                           f"data.train_path={path}", "--dry-run"], cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (f"data error: {path}:1: not UTF-8 (byte 0xff at column 15); "
                                   "expected UTF-8 text: re-encode the file (e.g. iconv -f "
                                   "latin1 -t utf-8)")

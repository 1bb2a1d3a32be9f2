"""Prompt datasets from JSONL and Parquet files with configurable field names.

Every malformed row raises `DataError` naming `file:line` (JSONL, 1-based line numbers) or
`file: row N` (Parquet, 0-based row index), the key and what was expected; text that is not
UTF-8 too, with the offending byte and its column. Blank JSONL lines are skipped; a file without
any example is an error.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from rl.data.answers import EXPECTED_FORM, AnswerFormat, extract_answer
from rl.data.example import DataError, Example

SUFFIXES = (".jsonl", ".parquet")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _not_utf8(where: str, data: bytes, e: UnicodeDecodeError, lines: bool) -> DataError:
    """Names the first byte of `data` that is not UTF-8, by its 1-based byte column, and its
    1-based line after `where` when `lines` (`data` is a whole JSONL file)."""
    column = e.start - (data.rfind(b"\n", 0, e.start) + 1 if lines else 0) + 1
    if lines:
        line = data.count(b"\n", 0, e.start) + 1
        where += f":{line}"
    return DataError(f"{where}: not UTF-8 (byte 0x{data[e.start]:02x} at column {column}); "
                     "expected UTF-8 text: re-encode the file (e.g. iconv -f latin1 -t utf-8)")


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """Yields (location, parsed row) for each non-blank line."""
    try:
        yield from _jsonl_lines(path)
    except UnicodeDecodeError:
        data = path.read_bytes()  # only now: where the first bad byte is, by line and column
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _not_utf8(str(path), data, e, lines=True) from None
        raise


def _jsonl_lines(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                yield where, json.loads(line.rstrip())
            except json.JSONDecodeError as e:
                # json's messages that name a position themselves end in "at" ("Unterminated
                # string starting at"): the column completes them
                at = " " if e.msg.endswith(" at") else " at "
                raise DataError(f"{where}: invalid JSON ({e.msg}{at}column {e.colno}); "
                                "expected one JSON object per line") from None


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq  # only needed for Parquet files

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise DataError(f"{path}: cannot read Parquet file ({type(e).__name__}: {e})") from None
    try:
        rows = table.to_pylist()
    except UnicodeDecodeError:  # a string column holding other bytes: pyarrow reads them as is
        raise _parquet_not_utf8(path, table) from None
    for index, row in enumerate(rows):
        yield f"{path}: row {index}", row


def _parquet_not_utf8(path: Path, table) -> DataError:
    """The first value of `table` that is not UTF-8, as `file: row N: key 'K': ...`."""
    for name in table.column_names:
        column = table.column(name)
        for index in range(len(column)):
            try:
                column[index].as_py()
            except UnicodeDecodeError as e:
                return _not_utf8(f"{path}: row {index}: key '{name}'", e.object, e, lines=False)
    return DataError(f"{path}: not UTF-8")


def _row_to_example(where: str, row: Any, prompt_key: str, answer_key: str,
                    answer_format: AnswerFormat) -> Example:
    if not isinstance(row, dict):
        raise DataError(f"{where}: got {type(row).__name__} {_short(row)}, expected a JSON object "
                        f"with keys '{prompt_key}' and '{answer_key}'")
    for key in (prompt_key, answer_key):
        if key not in row:
            present = ", ".join(map(str, row)) or "none"
            raise DataError(f"{where}: missing key '{key}' (keys present: {present})")
    prompt = row[prompt_key]
    if not isinstance(prompt, str) or not prompt.strip():
        raise DataError(f"{where}: key '{prompt_key}': got {_short(prompt)}, "
                        "expected a non-empty string prompt")
    raw = row[answer_key]
    # Numbers are common as reference answers (`"answer": 42`); bools almost surely are mistakes.
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        raw = str(raw)
    if not isinstance(raw, str):
        raise DataError(f"{where}: key '{answer_key}': got {_short(raw)}, "
                        "expected a string or a number")
    answer = extract_answer(raw, answer_format)
    if answer is None:
        raise DataError(f"{where}: key '{answer_key}': got {_short(raw)}, expected "
                        f"{EXPECTED_FORM[answer_format]} (answer_format: {answer_format})")
    meta = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
    meta["source"] = where
    return Example(prompt=prompt, answer=answer, meta=meta)


def load_examples(path: str | Path, prompt_key: str = "question", answer_key: str = "answer",
                  answer_format: AnswerFormat = "auto") -> list[Example]:
    """All examples of a `.jsonl` or `.parquet` file, in file order. Raises DataError."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise DataError(f"{path}: unsupported file type '{path.suffix}', expected one of "
                        f"{', '.join(SUFFIXES)}")
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    rows = _jsonl_rows(path) if path.suffix == ".jsonl" else _parquet_rows(path)
    examples = [_row_to_example(where, row, prompt_key, answer_key, answer_format)
                for where, row in rows]
    if not examples:
        raise DataError(f"{path}: the file holds no examples (empty file), expected at least one "
                        f"row with keys '{prompt_key}' and '{answer_key}'")
    return examples

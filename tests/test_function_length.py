"""No function in `rl/` is longer than MAX_LINES, from its `def` line to its last line, docstring
included (issue 39): a longer one is split into named parts."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 80


def long_functions(package: Path, limit: int = MAX_LINES) -> list[str]:
    """`package/path.py:line name (N lines)` for each function or method under `package` longer
    than `limit` lines (decorators not counted)."""
    out = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    out.append(f"{path.relative_to(package.parent)}:{node.lineno} {node.name} "
                               f"({length} lines)")
    return out


def test_no_function_in_rl_is_longer_than_80_lines():
    long = long_functions(REPO / "rl")
    assert not long, f"functions over {MAX_LINES} lines (split them):\n" + "\n".join(long)


def test_a_function_counts_from_def_to_its_last_line(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES - 1))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f"@staticmethod\ndef fits():\n{body}\n\n\n"
                                           f"def too_long():\n{body}\n    x = 0\n")
    assert long_functions(tmp_path / "pkg") == [
        f"pkg/m.py:{MAX_LINES + 4} too_long ({MAX_LINES + 1} lines)"]

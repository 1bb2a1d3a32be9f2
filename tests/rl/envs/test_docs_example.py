"""docs/environments.md's minimal environment, copied as a user would, runs in the workers."""
import re
import sys
from pathlib import Path

from rl.envs.pool import EnvPool

DOC = Path(__file__).resolve().parents[3] / "docs" / "environments.md"


def test_the_documented_example_runs(tmp_path, monkeypatch):
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    (tmp_path / "my_env.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))  # the workers get the driver's sys.path
    pool = EnvPool("my_env:AdderEnv", 1, timeout_s=10.0)
    try:
        row = {"prompt": "2+3+4=", "answer": "9"}
        call = {"text": "[add: 2 3 4]", "turn": 1, "truncated": False,
                "tool_calls": [{"name": "add", "arguments": "2 3 4"}]}
        ((ok, (state, result)),) = pool.map([(row, None, call)])
        assert ok and result == (["9"], None, False)
        final = {"text": "9", "turn": 2, "truncated": False, "tool_calls": []}
        ((ok, (_, result)),) = pool.map([(row, state, final)])
        assert ok and result == (None, 1.0, True)
    finally:
        pool.close()
        sys.modules.pop("my_env", None)

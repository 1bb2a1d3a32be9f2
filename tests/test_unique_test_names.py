"""pytest imports test files without packages by their basename (rootdir import mode): two
test files of one name in different folders stop the whole collection ("import file
mismatch"), as tests/rl/test_dynamic_sampling.py and tests/rl/loop/... once did."""
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_no_two_test_files_share_a_name():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []

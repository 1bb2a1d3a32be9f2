"""The packages' layering, read from their source (ast): `launch/` (the commands) may import
`slurm/` and `job/`; `slurm/` (the allocation) imports `job/`, never `launch/`; `job/` (what both
launchers share) imports neither; `rl/` imports none of them. And no two modules of `launch/`,
`slurm/` and `job/` share a file name."""
import ast
from itertools import combinations
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = {"rl": {"launch", "slurm", "job"}, "job": {"launch", "slurm"}, "slurm": {"launch"},
             "launch": set()}
"""Package -> the packages it must not import (at any depth, lazily or for the type checker)."""


def imported_packages(path: Path) -> set[str]:
    """The top-level packages `path` imports (relative imports stay in their own package)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_downward(package):
    wrong = [f"{path.relative_to(REPO)} imports {name}"
             for path in sorted((REPO / package).rglob("*.py"))
             for name in sorted(imported_packages(path) & FORBIDDEN[package])]
    assert not wrong, "\n".join(wrong)


def test_launch_and_slurm_do_not_import_each_other():
    def imports(src: str, dst: str) -> bool:
        return any(dst in imported_packages(p) for p in (REPO / src).rglob("*.py"))
    assert imports("launch", "slurm")  # the one direction: the commands submit through slurm/
    assert not imports("slurm", "launch")


def test_module_file_names_are_distinct_across_launch_slurm_and_job():
    names = {pkg: {p.name for p in (REPO / pkg).rglob("*.py") if p.name != "__init__.py"}
             for pkg in ("launch", "slurm", "job")}
    shared = [f"{a}/ and {b}/ both have {n}" for a, b in combinations(sorted(names), 2)
              for n in sorted(names[a] & names[b])]
    assert not shared, "\n".join(shared)

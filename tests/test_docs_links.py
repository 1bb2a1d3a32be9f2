"""README.md and docs/*.md point only at things that exist, and README stays short.

Checked in every page: each relative Markdown link `[text](path)` (anchors dropped, web links
skipped), each backticked repository path that names a file (`rl/models/v4_precision.py`,
`bench/results/rollout.md`, globs such as `configs/*.yaml` must match at least one file), and
each backticked module of this repository (`rl.models.v4_attention`, `launch.submit`: the
module or a package prefix of it)."""
import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250

# what a backticked file path ends with
FILE_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".json", ".jsonl", ".sh", ".txt", ".lock",
                 ".cfg", ".toml", ".sbatch", ".log", ".ini")
PACKAGES = ("rl", "launch", "slurm", "bench")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE = re.compile(r"`([^`\n]+)`")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def expand_braces(pattern: str) -> list[str]:
    """`a_{x,y}.md` -> [`a_x.md`, `a_y.md`] (one level, as the pages write it)."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [out for alt in m.group(1).split(",")
            for out in expand_braces(pattern[:m.start()] + alt + pattern[m.end():])]


def file_paths(text: str, root: Path = ROOT) -> list[str]:
    """Backticked tokens that name a file under one of `root`'s top-level folders."""
    top = {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")}
    out = []
    for code in CODE.findall(text):
        for token in code.split():
            token = token.strip("(),;:'\"")
            if not token.endswith(FILE_SUFFIXES) or "/" not in token:
                continue
            if token.split("/", 1)[0] not in top:
                continue  # RUN_DIR/..., /shared/..., ~/..., a path inside another directory
            out.append(token)
    return out


def module_names(text: str) -> list[str]:
    """Backticked dotted names rooted in one of this repository's packages."""
    out = []
    for code in CODE.findall(text):
        for token in code.split():
            token = token.strip("(),;:'\"")
            if re.fullmatch(r"[a-z_]+(\.[A-Za-z_0-9]+)+", token) and token.split(".")[0] in PACKAGES:
                out.append(token)
    return out


def relative_links(text: str) -> list[str]:
    links = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http:, https:, mailto:, an anchor on the same page
        links.append(target.split("#", 1)[0])
    return links


def exists(root: Path, pattern: str) -> bool:
    return all(glob.glob(str(root / p)) if any(c in p for c in "*?[") else (root / p).exists()
               for p in expand_braces(pattern))


def module_exists(root: Path, name: str) -> bool:
    """`a.b.c.Name`: some prefix of two or more parts is a module or package file."""
    parts = name.split(".")
    for n in range(len(parts), 1, -1):
        base = root.joinpath(*parts[:n])
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return True
    return False


def broken(page: Path, root: Path = ROOT) -> list[str]:
    """What `page` names that does not exist, one `page: kind target` line each."""
    text = page.read_text()
    name = page.relative_to(root) if page.is_relative_to(root) else page
    out = [f"{name}: link {t}" for t in relative_links(text)
           if t and not (page.parent / t).exists()]
    out += [f"{name}: file `{p}`" for p in file_paths(text, root) if not exists(root, p)]
    out += [f"{name}: module `{m}`" for m in module_names(text) if not module_exists(root, m)]
    return out


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_paths_exist(page):
    assert not broken(page)


def test_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_docs_pages_are_linked_from_readme():
    readme = (ROOT / "README.md").read_text()
    unlinked = [p.name for p in (ROOT / "docs").glob("*.md") if f"docs/{p.name}" not in readme]
    assert not unlinked


def test_the_checker_finds_what_is_broken(tmp_path):
    (tmp_path / "rl").mkdir()
    (tmp_path / "rl" / "__init__.py").write_text("")
    (tmp_path / "rl" / "real.py").write_text("")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "a.yaml").write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "there.md").write_text("")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "[ok](there.md) [ok, anchor](there.md#x) [web](https://example.com) [here](#top)\n"
        "`rl/real.py`, `configs/*.yaml`, `RUN_DIR/config.yaml`, `rl.real`, `rl.real.Thing`\n")
    assert broken(page, tmp_path) == []
    page.write_text(page.read_text() + "[gone](gone.md#x) `rl/gone.py` `configs/*.yml` "
                    "`rl.gone` `configs/{a,b}.yaml`\n")
    assert broken(page, tmp_path) == [
        "docs/page.md: link gone.md", "docs/page.md: file `rl/gone.py`",
        "docs/page.md: file `configs/*.yml`", "docs/page.md: file `configs/{a,b}.yaml`",
        "docs/page.md: module `rl.gone`"]

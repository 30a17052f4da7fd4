"""Every repository path the package's docstrings and comments, the README and the docs name exists, so a reader
who follows one finds the file (paths to files a run creates, such as converted/ or runs/, are not checked). A
Markdown file named without a folder (``TRAINING.md``) must exist somewhere in the repository: a note that cites a
design document the repository does not hold sends its reader nowhere."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# repository-relative paths of source, docs and scripts, as they are written in prose
PATH = re.compile(
    r"(?<![\w./-])((?:hf_qknorm|tests|docs|recipes|benchmarks|scripts)/[\w./-]*\w\.(?:py|md|sh|jsonl|json))(?![\w])"
)
# a Markdown file named on its own: not part of a longer path, a URL or a link target (links:
# tests/project/test_readme.py)
BARE_MD = re.compile(r"(?<![\w./-])(?<!\]\()([A-Za-z_][\w-]*\.md)(?![\w/])")
OUTPUTS = ("benchmarks/results/",)  # written by the benchmark runs themselves
SOURCES = [
    *sorted((ROOT / "hf_qknorm").rglob("*.py")),
    ROOT / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted((ROOT / "recipes").glob("*.py")),
    *sorted((ROOT / "benchmarks").glob("*.py")),
]


def _md_names() -> set[str]:
    """The names of the Markdown files the repository holds (tracked or not yet committed), in any folder."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    names = {Path(line).name for line in out.stdout.splitlines()}
    return names or {p.name for p in ROOT.rglob("*.md")}  # not a git checkout (an sdist)


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_exist(source):
    missing = sorted(
        {m for m in PATH.findall(source.read_text()) if not (ROOT / m).exists() and not m.startswith(OUTPUTS)}
    )
    assert not missing, f"{source.relative_to(ROOT)} names missing files: {missing}"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_markdown_files_exist(source):
    missing = sorted(set(BARE_MD.findall(source.read_text())) - _md_names())
    assert not missing, f"{source.relative_to(ROOT)} cites Markdown files the repository does not hold: {missing}"


def test_the_bare_name_rule_catches_a_missing_design_note():
    assert BARE_MD.findall("the formula to 1e-6 (DESIGN.md); see ``STYLE.md``") == ["DESIGN.md", "STYLE.md"]
    assert BARE_MD.findall("docs/kernels.md, [x](kernels.md), https://h.co/README.md") == []

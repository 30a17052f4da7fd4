"""Every repository path the package's docstrings and comments, the README and the docs name exists, so a reader
who follows one finds the file (paths to files a run creates, such as converted/ or runs/, are not checked)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# repository-relative paths of source, docs and scripts, as they are written in prose
PATH = re.compile(r"(?<![\w./-])((?:hf_qknorm|tests|docs|recipes|benchmarks|scripts)/[\w./-]*\w\.(?:py|md|sh|jsonl|json))(?![\w])")
OUTPUTS = ("benchmarks/results/",)  # written by the benchmark runs themselves
SOURCES = [*sorted((ROOT / "hf_qknorm").rglob("*.py")), ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_exist(source):
    missing = sorted({m for m in PATH.findall(source.read_text()) if not (ROOT / m).exists()
                      and not m.startswith(OUTPUTS)})
    assert not missing, f"{source.relative_to(ROOT)} names missing files: {missing}"

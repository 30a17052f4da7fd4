"""The README stays a five-minute read that covers the whole public API, and every relative link in it and in docs/
leads somewhere: the file exists and, when the link names a heading (`page.md#anchor`), the heading does too."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import hf_qknorm

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens kept), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a `# comment` in a code block is no heading
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= 250, f"README.md has {n} lines; detail belongs in docs/*.md"


def test_readme_api_table_names_every_public_name():
    table = "\n".join(line for line in README.read_text().splitlines() if line.startswith("| `"))
    missing = [n for n in hf_qknorm.__all__ if not re.search(rf"`{re.escape(n)}\b", table)]
    assert not missing, f"README's API table lacks {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    bad = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target} (no such heading)")
    assert not bad, f"{page.relative_to(ROOT)}: {bad}"

"""The README's coverage count and the committed tables are the records of `hf-qknorm coverage`: they agree."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _records(version: str) -> list[dict]:
    return json.loads((ROOT / "benchmarks" / "runs" / "coverage" / f"transformers-{version}.json").read_text())


def test_the_readme_count_is_the_committed_table_s():
    patched = sum(r["status"] == "patched" for r in _records("5.23"))
    readme = (ROOT / "README.md").read_text()
    said = re.search(r"\*\*(\d+) model types patched exactly on Transformers 5\.23\*\*", readme)
    assert said is not None and int(said.group(1)) == patched


def test_each_markdown_table_lists_its_records():
    for version in ("5.23", "5.4"):
        records = _records(version)
        table = (ROOT / "docs" / "coverage" / f"transformers-{version}.md").read_text()
        rows = dict(re.findall(r"^\| `([^`]+)` \| ([^|]+?) \|", table, flags=re.M))
        assert rows == {r["model_type"]: r["status"] for r in records}
        assert not any(r["status"] == "FAIL" for r in records)  # a released table has no failing type

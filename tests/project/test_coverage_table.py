"""The README's coverage count and the committed tables are the records of `hf-qknorm coverage`: they agree."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _records(version: str) -> list[dict]:
    return json.loads((ROOT / "benchmarks" / "runs" / "coverage" / f"transformers-{version}.json").read_text())


def test_the_readme_count_is_the_committed_table_s():
    """Text and multimodal types patched on the newest table (a multimodal type: its default config's text config is
    another config)."""
    import transformers
    from packaging.version import Version
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from hf_qknorm.upstream import NEWEST_TESTED
    from hf_qknorm.verification.tiny import is_multimodal

    if Version(transformers.__version__) < Version(NEWEST_TESTED):
        pytest.skip(f"the table's types are classified by Transformers {NEWEST_TESTED}'s configs")

    records = [r for r in _records("5.24") if r["status"] == "patched"]
    multimodal = sum(is_multimodal(CONFIG_MAPPING[r["model_type"]]()) for r in records)
    readme = " ".join((ROOT / "README.md").read_text().split())
    pattern = r"\*\*(\d+) text model types patched exactly on Transformers 5\.24\*\*, and (\d+) multimodal"
    said = re.search(pattern, readme)
    assert said is not None and (int(said.group(1)), int(said.group(2))) == (len(records) - multimodal, multimodal)


def test_each_markdown_table_lists_its_records():
    for version in ("5.24", "5.23", "5.4"):
        records = _records(version)
        table = (ROOT / "docs" / "coverage" / f"transformers-{version}.md").read_text()
        rows = dict(re.findall(r"^\| `([^`]+)` \| ([^|]+?) \|", table, flags=re.M))
        assert rows == {r["model_type"]: r["status"] for r in records}
        assert not any(r["status"] == "FAIL" for r in records)  # a released table has no failing type

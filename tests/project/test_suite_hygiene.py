"""The test suite itself: a test module that defines the same name twice runs only the second definition, so the
first test silently stops running."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_module_defines_a_test_twice():
    repeated = {}
    for path in sorted(TESTS.rglob("*.py")):
        body = ast.parse(path.read_text(encoding="utf-8")).body
        names = collections.Counter(n.name for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)))
        if dup := sorted(name for name, count in names.items() if count > 1):
            repeated[str(path.relative_to(TESTS))] = dup
    assert not repeated, f"defined more than once (only the last runs): {repeated}"

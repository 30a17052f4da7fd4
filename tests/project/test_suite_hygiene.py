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


def test_no_test_folder_shadows_a_package():
    """tests/ is on sys.path (pyproject: pythonpath), so each folder in it is importable as a namespace package of
    its name: a folder named like a package some library looks for makes that library believe it is installed
    (a folder named ``kernels`` made Transformers 5.4 read the version of the ``kernels`` package, 'N/A', and fail
    to import its own tests)."""
    import importlib.metadata
    import re

    import transformers.utils.import_utils as import_utils

    probed = set(re.findall(r"_is_package_available\(\s*\"(\w+)\"", Path(import_utils.__file__).read_text()))
    installed = set(importlib.metadata.packages_distributions())
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert folders, TESTS
    assert not folders & (probed | installed), sorted(folders & (probed | installed))

"""The test suite itself: a test module that defines the same name twice runs only the second definition, so the
first test silently stops running; the ``spawns`` marker is checked."""

from __future__ import annotations

import ast
import collections
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


def test_no_module_defines_a_test_twice():
    repeated = {}
    for path in sorted(TESTS.rglob("*.py")):
        body = ast.parse(path.read_text(encoding="utf-8")).body
        names = collections.Counter(n.name for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)))
        if dup := sorted(name for name, count in names.items() if count > 1):
            repeated[str(path.relative_to(TESTS))] = dup
    assert not repeated, f"defined more than once (only the last runs): {repeated}"


def test_tests_are_a_package_and_not_on_sys_path():
    """tests/ is a package imported in pytest's importlib mode (pyproject), never a folder on sys.path: a test folder
    on sys.path is importable under its bare name, and one named like a package some library looks for makes that
    library believe it is installed (a folder named ``kernels`` once made Transformers read the version of the
    ``kernels`` package, 'N/A', and fail to import its own tests). Every folder with test code is a package, so
    helpers are imported as ``tests._support...``."""
    import sys

    assert 'addopts = ["--import-mode=importlib"]' in (TESTS.parent / "pyproject.toml").read_text()
    assert str(TESTS) not in {str(Path(p).resolve()) for p in sys.path if p}
    shims = TESTS / "transformers_suite" / "shims"  # a search path of Transformers' test package, not ours
    folders = {p.parent for p in TESTS.rglob("*.py") if shims not in p.parents and "__pycache__" not in p.parts}
    assert not {f for f in folders if not (f / "__init__.py").is_file()}, "add an __init__.py"


@pytest.mark.spawns
def test_the_spawns_marker_is_checked_both_ways(tmp_path):
    """tests/conftest.py fails a test that starts a process unmarked and a marked one that starts none (so that
    ``-m "not spawns"`` is the in-process suite), and lets a ``git`` call and a shared launch pass."""
    (tmp_path / "test_probe.py").write_text(
        "import subprocess, sys, pytest\n"
        "def test_unmarked():\n    subprocess.run([sys.executable, '-c', 'pass'])\n"
        "@pytest.mark.spawns\ndef test_marked():\n    subprocess.run([sys.executable, '-c', 'pass'])\n"
        "@pytest.mark.spawns\ndef test_marked_idle():\n    pass\n"
        "@pytest.mark.spawns(shared=True)\ndef test_shared_idle():\n    pass\n"
        "def test_git():\n    subprocess.run(['git', '--version'], capture_output=True)\n"
        "def test_multiprocessing():\n"
        "    import multiprocessing as mp\n"
        "    p = mp.get_context('spawn').Process(target=print); p.start(); p.join()\n"
    )
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-q", "-rf", str(tmp_path / "test_probe.py")],
        cwd=TESTS.parent, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    failed = {line.split("::")[1].split(" ")[0] for line in res.stdout.splitlines() if line.startswith("FAILED")}
    assert failed == {"test_unmarked", "test_marked_idle", "test_multiprocessing"}, res.stdout[-3000:]
    assert "3 failed, 3 passed" in res.stdout, res.stdout[-3000:]

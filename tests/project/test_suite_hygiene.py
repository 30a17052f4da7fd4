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
    ``-m "not spawns"`` is the in-process suite), and lets a ``git`` call, a shared launch and Triton's own toolchain
    (a GPU compile) pass."""
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
        "def test_triton_toolchain():\n"  # ptxas and the launcher's C compiler, run from inside Triton's package
        '    code = \'import subprocess, sys; subprocess.run([sys.executable, "-c", "pass"])\'\n'
        "    exec(compile(code, '/site-packages/triton/backends/nvidia/compiler.py', 'exec'), {})\n"
    )
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-q", "-rf", str(tmp_path / "test_probe.py")],
        cwd=TESTS.parent, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    failed = {line.split("::")[1].split(" ")[0] for line in res.stdout.splitlines() if line.startswith("FAILED")}
    assert failed == {"test_unmarked", "test_marked_idle", "test_multiprocessing"}, res.stdout[-3000:]
    assert "3 failed, 4 passed" in res.stdout, res.stdout[-3000:]


LAUNCHERS = {"run", "Popen", "check_call", "check_output", "call", "start"}  # subprocess / multiprocessing calls


def _launching_names(tree: ast.Module) -> set[str]:
    """The module-level functions of ``tree`` that start a process, directly (a ``subprocess``/``multiprocessing``
    call) or through another of them."""
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def calls(node) -> set[str]:
        out = set()
        for call in (c for c in ast.walk(node) if isinstance(c, ast.Call)):
            f = call.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                out.add(f"{f.value.id}.{f.attr}")
            elif isinstance(f, ast.Name):
                out.add(f.id)
        return out

    def launches(node) -> bool:  # a git call is allowed (the guard lets it pass)
        for call in (c for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)):
            owner = call.func.value.id if isinstance(call.func.value, ast.Name) else ""
            if owner in ("subprocess", "mp", "multiprocessing") and call.func.attr in LAUNCHERS:
                first = call.args[0] if call.args else None
                words = first.elts if isinstance(first, (ast.List, ast.Tuple)) else []
                if not (words and getattr(words[0], "value", None) == "git"):
                    return True
        return False

    direct = {name for name, node in defs.items() if launches(node)}
    found, grew = set(direct), True
    while grew:
        grew = False
        for name, node in defs.items():
            if name not in found and (calls(node) | {a.arg for a in node.args.args}) & found:
                found.add(name)
                grew = True
    return found


def _marked_spawns(node) -> bool:
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(target, ast.Attribute) and target.attr == "spawns":
            return True
    return False


def test_tests_that_reach_a_launch_are_marked_spawns():
    """A test that requests a fixture or calls a helper of its module that starts processes -- a launch shared with
    the module's other tests included -- carries the ``spawns`` marker: unmarked, it runs under ``-m "not spawns"``
    and starts the launch itself there (which the guard in tests/conftest.py fails), while a full run, where a
    marked test started it first, never shows it."""
    unmarked = []
    for path in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(path.read_text(), str(path))
        launching = _launching_names(tree)
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_") or _marked_spawns(node):
                continue
            used = {a.arg for a in node.args.args}
            used |= {c.func.id for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
            if used & launching:
                via = ", ".join(sorted(used & launching))
                unmarked.append(f"{path.relative_to(TESTS.parent)}::{node.name} ({via})")
    assert not unmarked, "reach a process launch without @pytest.mark.spawns: " + "; ".join(unmarked)

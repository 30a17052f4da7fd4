"""The package's architecture, checked: no import cycles (function-level imports included), the floors import
one way only (portable <- kernels <- attention <- modeling <- conversion / training / verification <- cli; see
docs/architecture.md), kernels know nothing of Transformers, and every subpackage imports on its own in a fresh
interpreter."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hf_qknorm"
SUBPACKAGES = ("portable", "kernels", "attention", "modeling", "conversion", "training", "verification", "cli")
# what each floor may import from the package besides itself: whole floors, never single modules
RUNTIME = {"portable", "kernels", "attention", "modeling", "_version", "upstream"}
ALLOWED = {
    "portable": set(),  # and only torch and the standard library: tests/portable/test_boundary.py
    "kernels": set(),
    "attention": {"portable", "kernels", "_version", "upstream"},
    "modeling": {"portable", "kernels", "attention", "_version", "upstream"},
    "conversion": RUNTIME | {"data", "reference", "verification"},
    "training": RUNTIME | {"data"},
    "verification": RUNTIME | {"reference"},
    "cli": RUNTIME | {"conversion", "training", "verification", "data", "reference"},
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every hf_qknorm module ``path`` imports, at any depth (function-level imports included)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("hf_qknorm"):
                out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names)  # `from . import hooks` imports a module
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("hf_qknorm"))
    return out


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py") if "entry" not in p.parts}
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in _imports(path) if m in modules and m != name}
    return graph


def test_no_import_cycles():
    graph = _graph()
    # Tarjan-free check: depth-first search for a back edge, reporting the cycle
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt.startswith(node + ".") or node == "hf_qknorm":  # a package importing its own parts is no cycle
                continue
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt) :] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_dependency_direction():
    graph = _graph()
    for name, deps in graph.items():
        parts = name.split(".")
        if len(parts) < 2 or parts[1] not in ALLOWED:
            continue
        own = parts[1]
        for dep in deps:
            dparts = dep.split(".")
            if dep == "hf_qknorm" or dparts[1] == own:
                continue
            assert dparts[1] in ALLOWED[own], f"{name} imports {dep}: the {own} floor may import {sorted(ALLOWED[own])}"


def test_kernels_know_nothing_of_transformers():
    for path in (PACKAGE / "kernels").rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not any(n.startswith("transformers") for n in names), path


def test_package_imports_no_test_tools():
    """Developer tools that patch with ``unittest.mock`` (scripts/compile_kernels.py) live outside the package."""
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not any(n.split(".")[0] in ("unittest", "pytest") for n in names), path


# One interpreter imports the third-party packages once, then forks a child per subpackage that imports it with
# no module of the package loaded: the order of the package's own imports is the one a fresh interpreter has, at a
# fraction of eight start-ups.
_IMPORT_ALONE = """
import importlib, json, os, sys, traceback
import torch, transformers.modeling_utils
assert not any(m == "hf_qknorm" or m.startswith("hf_qknorm.") for m in sys.modules)
codes = {}
for sub in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module("hf_qknorm." + sub)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        os._exit(0)
    codes[sub] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps(codes))
"""


@pytest.fixture(scope="module")
def imported_alone():
    res = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALONE, *SUBPACKAGES], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.splitlines()[-1]), res.stderr


@pytest.mark.spawns(shared=True)
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("sub", SUBPACKAGES)
def test_each_subpackage_imports_alone(sub, imported_alone):
    codes, stderr = imported_alone
    assert codes[sub] == 0, stderr


def test_the_command_line_has_one_table_of_commands():
    """Every ``hf-qknorm`` subcommand is a row of ``cli/main.py``'s COMMANDS; no module registers one on import (a
    list appended to from a module that imports ``main`` hid a main <-> convert cycle), and the package has one
    ``__main__``, the CLI's."""
    from hf_qknorm.cli.main import COMMANDS, build_parser

    assert [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("__main__.py")] == ["cli/__main__.py"]
    for path in (PACKAGE / "cli").glob("*.py"):
        if path.name in ("main.py", "__init__.py", "__main__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.module not in ("main", "hf_qknorm.cli.main", "hf_qknorm.cli"), (path.name, node.module)
                assert not (node.level == 1 and node.module is None and any(a.name == "main" for a in node.names))
    names = ["demo", "inspect", "info", "verify", "convert", "push", "coverage"]
    assert [row[0] for row in COMMANDS] == names
    parser, runners = build_parser()
    assert list(runners) == names and "{" + ",".join(names) + "}" in parser.format_usage()


def test_the_longest_files_named_for_the_workers_exist():
    """tests/conftest.py's LONGEST_FIRST names test files; a renamed one would silently lose its place."""
    from tests.conftest import LONGEST_FIRST

    root = PACKAGE.parent
    missing = [path for path in LONGEST_FIRST if not (root / path).is_file()]
    assert not missing, missing

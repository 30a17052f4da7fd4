"""Every name the benchmark, script and recipe files import from the package exists.

They import inside functions (after argument parsing, behind options such as ``--log``), so a renamed function
breaks them only when that branch runs: ``bench_heal.py --log`` failed at start for a whole stop after a rename. This
reads their imports at any depth and resolves each one."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted(p for folder in ("benchmarks", "scripts", "examples", "recipes") for p in (ROOT / folder).rglob("*.py"))


def _package_imports(path: Path) -> list[tuple[str, str, int]]:
    """(module, name, line) for each ``from hf_qknorm... import name`` in ``path``, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "hf_qknorm":
            out.extend((node.module, alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.Import):
            out.extend((a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == "hf_qknorm")
    return out


def test_the_files_are_found():
    names = {p.name for p in FILES}
    assert {"bench_heal.py", "build_smollm2.py"} <= names
    assert sum(len(_package_imports(p)) for p in FILES) > 50


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_package_name_a_tool_imports_exists(path):
    missing = []
    for module, name, line in _package_imports(path):
        try:
            owner = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"line {line}: {module} ({exc})")
            continue
        if name and not hasattr(owner, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"line {line}: {module}.{name}")
    assert not missing, f"{path.relative_to(ROOT)} imports what the package does not have: {missing}"

"""Every float literal in a Triton kernel is one that Triton types as float32.

Triton types a Python float literal as float32 only where it is a normal float32 (or 0, inf, nan); a smaller one (say
``1e-38``, below float32's smallest normal 2**-126) or a larger finite one becomes a float64 scalar. Triton 3.6 then
promotes the arithmetic around it to float64 and refuses the kernel ("Inconsistent return types", "Mismatched type
... fp64"), while newer Triton keeps the tensor's float32: the interpreter and CI's compile check both pass, and only
a GPU with Triton 3.6 sees the error (the fused lp norm kernels, 2026-11-30). This reads the kernels' source, so it
holds on every Triton.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[2] / "hf_qknorm" / "kernels"
FLOAT32_TINY = 2.0**-126
FLOAT32_MAX = (2 - 2.0**-23) * 2.0**127


def _typed_float64(x: float) -> bool:
    """Triton's rule for a float literal (triton.language.semantic): float64 unless 0, inf, nan or a normal float32."""
    a = abs(x)
    return not (a == 0 or math.isinf(a) or math.isnan(a) or FLOAT32_TINY <= a <= FLOAT32_MAX)


def _jit_functions(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
            yield node


def _float64_literals(path: Path) -> list[str]:
    found = []
    for fn in _jit_functions(ast.parse(path.read_text())):
        for node in ast.walk(fn):
            if isinstance(node, ast.Constant) and isinstance(node.value, float) and _typed_float64(node.value):
                found.append(f"{path.name}:{node.lineno} {fn.name}: {node.value!r}")
    return found


def test_the_rule_flags_what_triton_types_as_float64():
    assert _typed_float64(1e-38) and _typed_float64(1e-45) and _typed_float64(1e39)
    assert not any(map(_typed_float64, (0.0, 1.0, -2.5, 1.1754943508222875e-38, 1e38, math.inf, math.nan)))
    tree = ast.parse("import triton\n@triton.jit\ndef k(x):\n    return max(x, 1e-38)\ndef host():\n    return 1e-40\n")
    assert [fn.name for fn in _jit_functions(tree)] == ["k"]


@pytest.mark.parametrize("path", sorted(KERNELS.glob("*.py")), ids=lambda p: p.name)
def test_no_kernel_literal_is_typed_float64(path):
    assert not _float64_literals(path), "float literals Triton 3.6 computes in float64: " + "; ".join(
        _float64_literals(path)
    )

"""The kernel tests' shared set-up: every module here runs the Triton kernels or the scripts built on them.

``triton.jit`` picks compiled or interpreted when a kernel is decorated, so the mode is chosen before anything
imports triton: tests/conftest.py sets ``TRITON_INTERPRET=1`` on a machine without CUDA (CI, scripts/test.sh), where
the kernels take CPU tensors; on a GPU (scripts/test_gpu.sh unsets it) they run compiled on CUDA tensors. Test
modules read the outcome here as ``INTERPRETED`` and ``DEVICE`` (``from tests.kernels.conftest import DEVICE``:
values fixed at import, which decorators and parametrisations need, so not fixtures). Without triton every module
here is skipped, with the reason.
"""

from __future__ import annotations

import pytest
import torch

try:
    import triton  # noqa: F401
except ImportError as exc:
    NO_TRITON = f"could not import 'triton': {exc}"
else:
    NO_TRITON = None
    from hf_qknorm.kernels import attention as attn_mod
    from hf_qknorm.kernels._common import is_interpreted

    INTERPRETED = is_interpreted(attn_mod._attn_fwd_kernel)
    if not INTERPRETED and not torch.cuda.is_available():
        raise RuntimeError(
            "hf_qknorm.kernels was imported in compiled mode on a machine without CUDA: set TRITON_INTERPRET=1 "
            "before anything imports the kernels (tests/conftest.py does, unless it is set otherwise)"
        )
    DEVICE = "cpu" if INTERPRETED else "cuda"

    # Tests that push CPU tensors through the kernels, which only the interpreter accepts; skipped on a GPU.
    needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU tensors)")


class _WithoutTriton(pytest.Module):
    """A test module reported as skipped, never imported (its imports need triton)."""

    def collect(self):
        pytest.skip(NO_TRITON, allow_module_level=True)


def pytest_pycollect_makemodule(module_path, parent):
    if NO_TRITON is not None:
        return _WithoutTriton.from_parent(parent, path=module_path)
    return None

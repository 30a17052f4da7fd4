"""Shared fixtures: tiny models built from configs (no downloads) and the ``cuda`` marker."""

from __future__ import annotations

import os

# Some virtual machines advertise AMX but trap on it: oneDNN's bf16 kernels then die with "Illegal instruction".
# Capping oneDNN at AVX-512 BF16 keeps bf16 tests running everywhere (read at oneDNN's first use).
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton kernels run on CPU through the interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tiny models: thread start-up costs more than the work, and a second thread contends badly on small machines.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread for every test module, restored after it (a conversion or benchmark inside a test may
    change it): on a shared 2-core machine two threads make these small models 20-50x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def seeded():
    """Torch's global generator seeded before every test: a test that draws from it sees the same numbers whichever
    tests ran before it in its process (scripts/test.sh spreads test files over worker processes)."""
    torch.manual_seed(0)


@pytest.fixture
def tiny():
    from tests._support.tiny_models import tiny_model

    return tiny_model


@pytest.fixture
def kernels_on_cpu():
    """For tests that push CPU tensors through the Triton kernels: those run only under Triton's interpreter
    (``TRITON_INTERPRET=1``, as CI and scripts/test.sh run), so elsewhere -- a GPU machine, where tests/kernels runs
    the kernels on CUDA -- the test is skipped with the reason, never run through a compiler that needs a GPU."""
    from hf_qknorm import kernels

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors through the Triton kernels need TRITON_INTERPRET=1")
    if (reason := kernels.unavailable_reason()) is not None:
        pytest.skip(reason)

"""Shared fixtures: tiny models built from configs (no downloads) and the ``cuda`` marker."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run on CPU through the interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tiny():
    from tiny_models import tiny_model

    return tiny_model

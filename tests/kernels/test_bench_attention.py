"""benchmarks/bench_attention.py's providers compute what they are named for (tiny CPU inputs, the kernels under
Triton's interpreter); the timing itself needs a GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.kernels.conftest import needs_interpreter

pytestmark = needs_interpreter

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_attention.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_attention", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_providers_agree(bench):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16) * 3 for _ in range(3))
    scaling, cap = 16**-0.5, 2.0
    ref_nocap = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)
    ref_cap = bench._eager_cap(q, k, v, scaling, cap)
    assert (ref_cap - ref_nocap).abs().max() > 1e-2  # the cap changes the result at these logits
    for name, ref in (("qknorm-nocap", ref_nocap), ("qknorm-triton", ref_cap), ("sdpa", ref_nocap)):
        fn, leaves = bench.make_provider(name, q, k, v, scaling, cap)
        torch.testing.assert_close(fn(), ref, atol=2e-4, rtol=2e-4)
    assert set(bench.UNCAPPED) <= set(bench.PROVIDERS)
    for name in ("sdpa-cudnn", "sdpa-flash", "sdpa-efficient"):
        fn, leaves = bench.make_provider(name, q, k, v, scaling, cap)
        assert callable(fn) and len(leaves) == 3


def test_sdpa_pick_names_a_backend(bench):
    q = torch.randn(1, 2, 8, 16)
    assert bench.sdpa_pick(q, q, q, 0.25) in ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "?")

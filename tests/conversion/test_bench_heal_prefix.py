"""``benchmarks/bench_heal.py --prefix-model``: the greedy prefix agreement that top-1 agreement alone gives.

Checked against what the script does not compute: a hand-worked case, and answers whose misses are drawn
independently and scored by the rule of :mod:`hf_qknorm.conversion.orchestration.agreement` (the prefix of an
answer is its first teacher-forced miss)."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("bench_heal", ROOT / "benchmarks" / "bench_heal.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_expected_prefix_by_hand():
    bench = _script()
    assert bench.expected_prefix(1.0) == 1.0
    assert bench.expected_prefix(0.0) == 0.0
    # two tokens, each kept with probability 1/2: prefix 0 (1/2), 1/2 (1/4), 1 (1/4) -> 0.375
    assert bench.expected_prefix(0.5, n=2) == pytest.approx(0.375)


def test_the_expected_prefix_is_what_independent_misses_give():
    bench = _script()
    rng = random.Random(0)
    for top1 in (0.78, 0.9, 0.95):
        prefixes = []
        for _ in range(20000):
            hits = [int(rng.random() < top1) for _ in range(16)]
            prefixes.append((hits.index(0) if 0 in hits else 16) / 16)
        assert sum(prefixes) / len(prefixes) == pytest.approx(bench.expected_prefix(top1), abs=0.006)


def test_the_top1_a_prefix_needs_inverts_it_and_bad_input_is_refused():
    bench = _script()
    for top1 in (0.5, 0.9, 0.912, 0.99):
        assert bench.top1_for_prefix(bench.expected_prefix(top1)) == pytest.approx(top1, abs=1e-9)
    assert 0.91 < bench.top1_for_prefix(0.5) < 0.915
    with pytest.raises(ValueError, match="prefix 1.5: must be between 0 and 1"):
        bench.top1_for_prefix(1.5)


def test_the_table_sets_each_row_beside_its_expectation():
    bench = _script()
    rows = [
        {"src": "", "scheme": "qk_norm", "norm": "rmsnorm", "softcap": None, "top1_agreement": 0.9,
         "prefix_agreement": 0.5, "new_tokens": 16},
        {"src": "", "scheme": "qk_norm", "norm": "rmsnorm", "softcap": None, "top1_agreement": 1.0,
         "prefix_agreement": 1.0, "new_tokens": 16},
    ]  # fmt: skip
    out = bench.prefix_model(rows)
    want = bench.expected_prefix(0.9)
    assert f"| 90.0% | 50.0% | {100 * want:.1f}% | {100 * (0.5 - want):+.1f} |" in out
    assert "| 100.0% | 100.0% | 100.0% | +0.0 |" in out
    assert "2 rows: measured minus expected" in out and "expected at top-1 91.2%" in out

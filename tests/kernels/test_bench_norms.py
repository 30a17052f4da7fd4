"""benchmarks/bench_norms.py: its fused provider is the kernel and agrees with the module, its rows say what ran,
and a bad tile variant is refused in one line (tiny CPU inputs under Triton's interpreter; timing needs a GPU)."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.kernels.conftest import needs_interpreter

pytestmark = needs_interpreter

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_norms.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_norms", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rows_for_every_kind_and_variant(bench, tmp_path):
    from hf_qknorm.kernels import norms

    before = norms.TILE_ELEMENTS_FWD
    out = tmp_path / "rows.jsonl"
    args = ["--device", "cpu", "--seqlens", "8", "--tokens", "8", "--hidden", "32", "--head-dims", "16"]
    args += ["--warmup", "0", "--reps", "1", "--dtype", "fp32", "--tiles", "4096:2048:4:4", "64:32:2:4"]
    args += ["--out", str(out)]
    assert bench.main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # 3 kinds x (aten + 2 variants) x 2 modes
    assert len(rows) == 18
    assert {r["kind"] for r in rows} == set(bench.KINDS)
    fused_rows = [r for r in rows if r["provider"] != "aten"]
    assert {r["provider"] for r in fused_rows} == {"fused 4096:2048:4:4", "fused 64:32:2:4"}
    for row in fused_rows:  # the kernel computes what the module computes, at every variant
        assert row["max_diff_vs_aten"] is not None and row["max_diff_vs_aten"] < 0.1, row
        assert row["tiles"]["TILE_ELEMENTS_FWD"] in (4096, 64)
    assert all(r["max_diff_vs_aten"] is None for r in rows if r["provider"] == "aten")
    assert all(r["batch"] == 1 and r["heads"] == 2 and r["ms"] > 0 for r in rows)
    assert norms.TILE_ELEMENTS_FWD == before  # the committed setting is put back


def test_the_fused_provider_runs_the_kernel(bench, monkeypatch):
    from hf_qknorm.kernels import norms

    calls = []
    real = norms.head_norm
    monkeypatch.setattr(norms, "head_norm", lambda *a, **k: calls.append(k["kind"]) or real(*a, **k))
    norm = bench.make_norm("rmsnorm", 16, torch.float32, "cpu")
    x = torch.randn(2, 3, 16, requires_grad=True)
    from hf_qknorm.attention import kernel_policy

    with kernel_policy(devices=("cpu",)):
        torch.testing.assert_close(bench.fused(norm, x), norm(x), atol=1e-5, rtol=1e-5)
    assert calls == ["rmsnorm"]


@pytest.mark.parametrize("text", ["4096:2048:4", "a:b:c:d", "4096:0:4:4", ""])
def test_bad_tile_variant(bench, text):
    with pytest.raises(argparse.ArgumentTypeError, match="FWD_ELEMENTS:BWD_ELEMENTS"):
        bench.tile_variant(text)


def test_cpu_needs_the_interpreter(bench, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert bench.main(["--device", "cpu"]) == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().out

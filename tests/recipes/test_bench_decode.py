"""The decode benchmark's token table on the tiny shape: one row per cell, every scheme's ratio, the Markdown table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_decode


def test_token_table_times_every_scheme_against_the_unpatched_model():
    row = bench_decode.token_cell("tiny", batch=2, prompt=8, rounds=2, schemes=["qk_norm", "qk_norm_cap"])
    assert row["table"] == "token" and row["cache"] == "dynamic" and (row["batch"], row["prompt"]) == (2, 8)
    assert row["sdpa_us"] > 0
    # a ratio of CPU times of the same work on one machine: far from 0 and from infinity, whatever the machine
    assert all(0.05 < row[f"{s}_cpu"] < 20 for s in ("qk_norm", "qk_norm_cap"))
    table = bench_decode.markdown([row])
    assert "| sdpa us/forward | `qk_norm` | `qk_norm_cap` |" in table
    assert f"| tiny | dynamic | 2 | 8 | {row['sdpa_us']} | {row['qk_norm_cpu']:.2f}x |" in table


def test_token_table_leaves_the_cache_as_it_found_it():
    """Each timed forward's key/value are cropped away: every forward sees the prompt's cache, never a growing one."""
    from transformers import DynamicCache

    seen = []
    original = DynamicCache.crop

    def crop(self, n):
        original(self, n)
        seen.append(self.get_seq_length())

    DynamicCache.crop = crop
    try:
        bench_decode.token_cell("tiny", batch=1, prompt=5, rounds=1, schemes=["qk_norm"])
    finally:
        DynamicCache.crop = original
    assert seen and set(seen) == {5}


def test_token_table_refuses_caches_it_does_not_time():
    """The token table times the dynamic cache only: asking it for another is an error naming it, not a silent swap."""
    script = Path(bench_decode.__file__)
    res = subprocess.run(
        [sys.executable, str(script), "--table", "token", "--caches", "static", "--no-save"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 2
    assert "--table token times the dynamic cache only, got --caches static" in res.stderr

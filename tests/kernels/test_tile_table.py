"""The frozen tile table (hf_qknorm/kernels/_tile_table.py): validation, lookup, fallback, and that an entry reaches
the launch (under the interpreter, the "interpreter" arch key)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_qknorm.kernels import _tile_table
from hf_qknorm.kernels import attention as attn_mod
from hf_qknorm.reference import attention_reference
from tests.kernels.conftest import INTERPRETED

CPU = torch.device("cpu")
KEY = ("sm90", "fwd", 128, True, "bfloat16")
GOOD = {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3}


def test_committed_table_is_valid_and_holds_no_interpreter_rows():
    _tile_table.check_table(_tile_table.TILES)
    assert not [key for key in _tile_table.TILES if key[0] == "interpreter"]


@pytest.mark.parametrize(
    "key, entry, words",
    [
        (("sm90", "fwd", 128, True), GOOD, "expected (arch"),
        (("hopper", "fwd", 128, True, "bfloat16"), GOOD, "arch 'hopper'"),
        (("sm90", "bwd", 128, True, "bfloat16"), GOOD, "direction 'bwd'"),
        (("sm90", "fwd", 96, True, "bfloat16"), GOOD, "head_dim 96"),
        (("sm90", "fwd", 128, 1, "bfloat16"), GOOD, "causal 1"),
        (("sm90", "fwd", 128, True, "bf16"), GOOD, "dtype 'bf16'"),
        (KEY, {**GOOD, "block_m": 96}, "block_m=96"),
        (KEY, {**GOOD, "block_n": 8}, "block_n=8"),
        (KEY, {**GOOD, "num_warps": 32}, "num_warps=32"),
        (KEY, {**GOOD, "num_warps": 3}, "num_warps=3"),
        (KEY, {**GOOD, "num_stages": 0}, "num_stages=0"),
        (KEY, {**GOOD, "num_stages": 6}, "num_stages=6"),
        (KEY, {k: v for k, v in GOOD.items() if k != "block_n"}, "missing ['block_n']"),
        (KEY, {**GOOD, "mode": "atomic"}, "unknown fields ['mode']"),
        (("sm90", "dkdv", 128, True, "bfloat16"), {**GOOD, "mode": "fused"}, "mode='fused'"),
        (("sm90", "decode", 128, True, "bfloat16"), GOOD, "unknown fields ['block_m']"),
    ],
)
def test_bad_entries_are_named_in_one_line(key, entry, words):
    with pytest.raises(ValueError) as err:
        _tile_table.check_table({key: entry})
    message = str(err.value)
    assert words in message and "\n" not in message
    assert repr(key) in message or "expected" in message


def test_good_entries_pass():
    _tile_table.check_table(
        {
            KEY: GOOD,
            ("sm80", "dkdv", 64, False, "float16"): {**GOOD, "mode": "atomic"},
            ("sm90", "decode", 256, True, "float32"): {"block_n": 32, "num_warps": 4, "num_stages": 1},
        }
    )


def test_lookup_buckets_head_dim_and_falls_back(monkeypatch):
    monkeypatch.setitem(_tile_table.TILES, KEY, dict(GOOD, block_m=64))
    assert _tile_table.lookup("sm90", "fwd", 80, True, "bfloat16")["block_m"] == 64  # 80 is in the 128 bucket
    assert _tile_table.lookup("sm90", "fwd", 64, True, "bfloat16") is None
    assert _tile_table.lookup("sm90", "fwd", 128, False, "bfloat16") is None
    assert _tile_table.lookup("sm80", "fwd", 128, True, "bfloat16") is None
    assert _tile_table.lookup("sm90", "fwd", 512, True, "bfloat16") is None


def test_config_reads_the_table_and_falls_back_to_configs(monkeypatch):
    monkeypatch.setattr(attn_mod, "_arch", lambda device, interpreted: "sm90")
    # Absent: today's fallback (2-byte tiles, halved for fp32).
    assert attn_mod._config("fwd", 128, torch.bfloat16, False, True, CPU) == attn_mod._CONFIGS["fwd"][128]
    bm, bn, _, stages = attn_mod._config("fwd", 128, torch.float32, False, True, CPU)
    assert (bm, bn, stages) == (64, 32, 1)
    assert attn_mod._bwd_mode(128, torch.bfloat16, True, CPU, False) == "separate"
    # Present: the entry, for that dtype and causality only.
    monkeypatch.setitem(_tile_table.TILES, KEY, dict(GOOD, block_m=64, block_n=32, num_warps=4, num_stages=2))
    monkeypatch.setitem(_tile_table.TILES, ("sm90", "dkdv", 128, True, "bfloat16"), dict(GOOD, mode="atomic"))
    assert attn_mod._config("fwd", 128, torch.bfloat16, False, True, CPU) == (64, 32, 4, 2)
    assert attn_mod._config("fwd", 128, torch.bfloat16, False, False, CPU) == attn_mod._CONFIGS["fwd"][128]
    assert attn_mod._config("fwd", 128, torch.float16, False, True, CPU) == attn_mod._CONFIGS["fwd"][128]
    assert attn_mod._bwd_mode(128, torch.bfloat16, True, CPU, False) == "atomic"
    assert attn_mod._bwd_mode(128, torch.bfloat16, False, CPU, False) == "separate"


def test_interpreter_keeps_its_small_tiles():
    assert attn_mod._arch(CPU, True) == "interpreter"
    assert attn_mod._config("fwd", 128, torch.bfloat16, True, True, CPU) == (32, 32, 4, 1)
    assert attn_mod._config("dq", 64, torch.float32, True, False, CPU) == (32, 32, 4, 1)


def test_bad_mode_is_refused():
    q = torch.zeros(1, 1, 4, 16)
    with pytest.raises(ValueError, match="mode='fused' is not one of"):
        attn_mod.attn_bwd(q, q, q, q, q, q[..., 0], scaling=1.0, mode="fused")


def _qkv(seed, tq=50, tk=50, h=4, hkv=2, d=32, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(1, h, tq, d), (1, hkv, tk, d), (1, hkv, tk, d), (1, h, tq, d)]
    return [torch.randn(s, generator=g) * (scale if i < 2 else 1.0) for i, s in enumerate(shapes)]


@pytest.mark.skipif(not INTERPRETED, reason="the 'interpreter' table rows are read under TRITON_INTERPRET=1")
@pytest.mark.parametrize("mode", ["separate", "atomic"])
def test_table_entry_reaches_the_launch(monkeypatch, mode):
    """Entries put in the table under the "interpreter" arch are what the kernels are launched with (recorded at
    the launch), and the results still match the float64 reference."""
    tiles = {
        "fwd": dict(block_m=16, block_n=64, num_warps=2, num_stages=1),
        "dkdv": dict(block_m=64, block_n=16, num_warps=2, num_stages=1, mode=mode),
        "dq": dict(block_m=16, block_n=16, num_warps=2, num_stages=1),
    }
    for direction, entry in tiles.items():
        monkeypatch.setitem(_tile_table.TILES, ("interpreter", direction, 64, True, "float32"), entry)
    monkeypatch.setattr(attn_mod, "is_interpreted", lambda kernel: True)  # the spies below are not kernels
    launched = []
    for name in ("_attn_fwd_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"):
        kernel = getattr(attn_mod, name)

        class Spy:
            def __init__(self, kernel, name):
                self.kernel, self.name = kernel, name

            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    launched.append((self.name, kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["num_warps"]))
                    return self.kernel[grid](*args, **kwargs)

                return launch

        monkeypatch.setattr(attn_mod, name, Spy(kernel, name))
    q, k, v, do = _qkv(3)
    kw = dict(scaling=32**-0.5, softcap=4.0, causal=True)
    out, lse = attn_mod.attn_fwd(q, k, v, **kw, decode=False)
    grads = attn_mod.attn_bwd(do, q, k, v, out, lse, **kw)
    expected = [("_attn_fwd_kernel", 16, 64, 2), ("_attn_bwd_dkdv_kernel", 64, 16, 2)]
    if mode == "separate":
        expected.append(("_attn_bwd_dq_kernel", 16, 16, 2))
    assert launched == expected
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*leaves, **kw)
    ref.backward(do.double())
    assert (out.double() - ref).abs().max() / ref.abs().max() < 1e-4
    for g, leaf in zip(grads, leaves):
        assert (g.double() - leaf.grad).abs().max() / leaf.grad.abs().max().clamp_min(0.1) < 1e-4


@pytest.mark.skipif(not INTERPRETED, reason="the 'interpreter' table rows are read under TRITON_INTERPRET=1")
def test_decode_entry_reaches_the_launch(monkeypatch):
    monkeypatch.setitem(
        _tile_table.TILES, ("interpreter", "decode", 64, True, "float32"), dict(block_n=16, num_warps=2, num_stages=1)
    )
    kernel, seen = attn_mod._attn_fwd_split_kernel, []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append((kwargs["BLOCK_N"], kwargs["num_warps"]))
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(attn_mod, "_attn_fwd_split_kernel", Spy())
    monkeypatch.setattr(attn_mod, "is_interpreted", lambda kernel: True)
    q, k, v, _ = _qkv(4, tq=1, tk=70)
    kw = dict(scaling=32**-0.5, softcap=4.0, causal=True)
    out, _ = attn_mod.attn_fwd(q, k, v, **kw, decode=True)
    assert seen == [(16, 2)]
    ref = attention_reference(*(t.double() for t in (q, k, v)), **kw)
    assert math.isclose(0.0, ((out.double() - ref).abs().max() / ref.abs().max()).item(), abs_tol=1e-4)


ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT / "benchmarks" / "sweep_tiles.py"


def _sweep(*args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(SWEEP), *args], capture_output=True, text=True, env=env, timeout=timeout, check=False
    )


@pytest.mark.spawns
@pytest.mark.slow
def test_sweep_dry_run_writes_timings_and_a_table(tmp_path):
    """--dry-run: every direction checked against the reference and timed under the interpreter, the jsonl and the
    winning table written with the device, versions, date and command; its result cannot be applied."""
    res = _sweep("--dry-run", "--out", str(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (jsonl,) = tmp_path.glob("*-tiles.jsonl")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert {r["direction"] for r in rows} == {"fwd", "fwd-tma", "dkdv", "dq", "atomic", "decode", "bwd-separate"}
    assert all(r["status"] == "ok" and r["ms"] > 0 for r in rows), rows
    assert all(r["max_rel_err"] < 1e-4 for r in rows if r["direction"] != "bwd-separate")
    (combined,) = [r for r in rows if r["direction"] == "bwd-separate"]  # dK/dV and dQ winners timed together
    assert combined["dkdv"]["mode"] == "separate" and "block_m" in combined["dq"]
    for field in ("device", "torch", "triton", "date", "command"):
        assert rows[0][field]
    result = json.loads(jsonl.with_suffix(".json").read_text())
    assert result["arch"] == "interpreter" and "--dry-run" in result["command"]
    assert {tuple(r["key"])[1] for r in result["tiles"]} == {"fwd", "dkdv", "dq", "decode"}
    _tile_table.check_table({tuple(r["key"]): r["entry"] for r in result["tiles"]})
    table = tmp_path / "table.py"
    shutil.copy(_tile_table.__file__, table)
    res = _sweep("--apply", str(jsonl.with_suffix(".json")), "--table", str(table))
    assert res.returncode != 0 and "dry run" in res.stderr
    assert table.read_text() == Path(_tile_table.__file__).read_text()


def _load(path):
    spec = importlib.util.spec_from_file_location("table_copy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _result(tmp_path, name, rows, arch="sm90"):
    path = tmp_path / name
    result = dict(arch=arch, device="NVIDIA H100", date="2026-11-26T00:00:00+00:00", dry_run=False, tiles=rows)
    path.write_text(json.dumps(result))
    return str(path)


@pytest.mark.spawns
def test_sweep_apply_merges_validated_rows(tmp_path):
    table = tmp_path / "table.py"
    shutil.copy(_tile_table.__file__, table)
    fwd = {"key": ["sm90", "fwd", 128, True, "bfloat16"], "entry": GOOD}
    dkdv = {"key": ["sm90", "dkdv", 128, True, "bfloat16"], "entry": {**GOOD, "block_m": 64, "mode": "atomic"}}
    other = {"key": ["sm80", "fwd", 64, False, "float16"], "entry": GOOD}
    assert _sweep("--apply", _result(tmp_path, "a.json", [other], arch="sm80"), "--table", str(table)).returncode == 0
    res = _sweep("--apply", _result(tmp_path, "b.json", [fwd, dkdv]), "--table", str(table))
    assert res.returncode == 0, res.stderr
    merged = _load(table)
    assert merged.TILES == {tuple(r["key"]): r["entry"] for r in (fwd, dkdv, other)}
    assert set(merged.SOURCES) == {"sm80", "sm90"} and "b.json" in merged.SOURCES["sm90"]
    assert max(len(line) for line in table.read_text().splitlines()) <= 120
    # A new sweep of the same arch replaces its rows; another arch's stay.
    res = _sweep("--apply", _result(tmp_path, "c.json", [dkdv]), "--table", str(table))
    assert res.returncode == 0
    assert _load(table).TILES == {tuple(r["key"]): r["entry"] for r in (dkdv, other)}
    # A bad row: refused in one line naming it, the table untouched.
    before = table.read_text()
    bad = {"key": ["sm90", "fwd", 128, True, "bfloat16"], "entry": {**GOOD, "num_warps": 3}}
    res = _sweep("--apply", _result(tmp_path, "d.json", [bad]), "--table", str(table))
    assert res.returncode != 0 and "num_warps=3" in res.stderr.strip().splitlines()[-1]
    assert table.read_text() == before


def test_shared_estimate_orders_tiles():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import sweep_tiles
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    small = sweep_tiles.shared_estimate("fwd", (64, 32, 4, 2), 128)
    assert small < sweep_tiles.shared_estimate("fwd", (64, 128, 4, 4), 128)
    assert sweep_tiles.shared_estimate("dkdv", (64, 128, 8, 2), 128) > 232448 // 4
    for direction, grid in sweep_tiles.GRIDS.items():
        for tiles in grid + list(sweep_tiles.DRY_GRIDS[direction]):
            key_direction, entry = sweep_tiles._entry(direction, tiles)
            _tile_table.check_entry(("sm90", key_direction, 128, True, "bfloat16"), entry)


@pytest.mark.spawns
def test_sweep_budget_stops_cleanly_and_writes(tmp_path):
    res = _sweep("--dry-run", "--out", str(tmp_path), "--budget-s", "0")
    assert res.returncode == 0, res.stderr[-3000:]
    (result,) = tmp_path.glob("*-tiles.json")
    data = json.loads(result.read_text())
    assert data["stopped"].startswith("budget: stopped before fwd hd64 causal=True candidate 0")
    assert data["tiles"] == [] and result.with_suffix(".jsonl").exists()

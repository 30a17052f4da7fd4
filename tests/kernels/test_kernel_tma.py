"""The forward's tensor-descriptor (TMA) loads: an opt-in variant, chosen by the tile table's ``tma`` or
``HF_QKNORM_TMA``, that must compute what the pointer loads compute.

Under Triton's interpreter on CPU the descriptors are emulated (a load past the descriptor's shape reads zeros, as
a TMA copy does); on a Hopper GPU the same tests run compiled. The compile test builds the variant for sm_90
without a GPU. Where the variant does not apply (another card, an odd head_dim, misaligned strides) the launcher
takes the pointer loads silently; those rules are checked here too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hf_qknorm.kernels import _tile_table
from hf_qknorm.kernels import attention as attn_mod
from hf_qknorm.kernels import attn_interface as api
from hf_qknorm.reference import attention_reference
from tests.kernels.conftest import DEVICE, INTERPRETED

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-4  # relative to the largest reference value (fp32 kernels against float64)
GOOD = dict(block_m=64, block_n=32, num_warps=4, num_stages=2)

needs_descriptors = pytest.mark.skipif(
    not attn_mod._tma_supported_here(), reason="this Triton has no tensor descriptors in kernels"
)


def _tma_here() -> bool:
    """Whether a launch on this test's device can take the descriptor loads at all."""
    if not attn_mod._tma_supported_here():
        return False
    return INTERPRETED or attn_mod._has_tma(torch.device("cuda"))


@pytest.fixture
def launches(monkeypatch):
    """The ``TMA`` flag of every forward launch."""
    kernel, seen = attn_mod._attn_fwd_kernel, []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs["TMA"])
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(attn_mod, "_attn_fwd_kernel", Spy())
    monkeypatch.setattr(attn_mod, "is_interpreted", lambda kernel: INTERPRETED)  # the launcher asks the kernel
    return seen


# --- the table's field ----------------------------------------------------------------------------------------


def test_table_takes_tma_on_fwd_rows_only():
    _tile_table.check_entry(("sm90", "fwd", 128, True, "bfloat16"), {**GOOD, "tma": True})
    _tile_table.check_entry(("sm90", "fwd", 128, True, "bfloat16"), {**GOOD, "tma": False})
    with pytest.raises(ValueError, match=r"unknown fields \['tma'\]"):
        _tile_table.check_entry(("sm90", "dq", 128, True, "bfloat16"), {**GOOD, "tma": True})
    with pytest.raises(ValueError, match="tma=1 is not True or False"):
        _tile_table.check_entry(("sm90", "fwd", 128, True, "bfloat16"), {**GOOD, "tma": 1})
    with pytest.raises(ValueError, match="block_n=512 with tma=True"):
        _tile_table.check_entry(("sm90", "fwd", 128, True, "bfloat16"), {**GOOD, "block_n": 512, "tma": True})
    _tile_table.check_entry(("sm90", "fwd", 128, True, "bfloat16"), {**GOOD, "block_n": 512})  # pointer loads


def test_committed_table_asks_for_no_tma():
    # Off until a sweep on a GPU has measured it faster.
    assert not any(entry.get("tma") for entry in _tile_table.TILES.values())


# --- where it applies -------------------------------------------------------------------------------------------


def _qkv(d=64, dtype=torch.float32):
    q = torch.zeros(1, 4, 8, d, dtype=dtype, device=DEVICE)
    k = torch.zeros(1, 2, 8, d, dtype=dtype, device=DEVICE)
    return q, k, k.clone()


@needs_descriptors
@pytest.mark.skipif(not INTERPRETED, reason="the rules are checked on the interpreter's CPU tensors")
def test_where_it_applies(monkeypatch):
    monkeypatch.delenv(attn_mod.TMA_ENV, raising=False)
    q, k, v = _qkv()
    on = {"tma": True}
    assert attn_mod._tma(on, q, k, v, False, 32, 32, True)
    assert not attn_mod._tma(None, q, k, v, False, 32, 32, True)  # nothing asks
    assert not attn_mod._tma({"tma": False}, q, k, v, False, 32, 32, True)
    assert not attn_mod._tma(on, q, k, v, False, 32, 32, False)  # not a CUDA tensor
    assert not attn_mod._tma(on, *_qkv(80), False, 32, 32, True)  # head_dim not a power of two
    assert not attn_mod._tma(on, *_qkv(8), False, 32, 32, True)  # under 16
    assert not attn_mod._tma(on, q, k, v, False, 32, 512, True)  # a block over TMA's 256 rows
    shifted = torch.zeros(1 * 2 * 8 * 64 + 1, device=DEVICE)[1:].view(1, 2, 8, 64)  # base 4 bytes off
    assert not attn_mod._tma(on, q, shifted, v, False, 32, 32, True)
    odd = torch.zeros(1, 2, 8, 66, device=DEVICE)[..., :64]  # rows 264 bytes apart: not a multiple of 16
    assert not attn_mod._tma(on, q, k, odd, False, 32, 32, True)
    view = torch.zeros(1, 8, 2, 64, device=DEVICE).transpose(1, 2)  # Transformers' layout, read in place
    assert attn_mod._tma(on, q, view, v, False, 32, 32, True)
    monkeypatch.setenv(attn_mod.TMA_ENV, "1")
    assert attn_mod._tma(None, q, k, v, False, 32, 32, True)
    monkeypatch.setenv(attn_mod.TMA_ENV, "off")
    assert not attn_mod._tma(on, q, k, v, False, 32, 32, True)  # the environment wins over the table
    monkeypatch.setenv(attn_mod.TMA_ENV, "maybe")
    with pytest.raises(ValueError, match="HF_QKNORM_TMA='maybe' is not one of"):
        attn_mod._tma(on, q, k, v, False, 32, 32, True)


@pytest.mark.parametrize("value", ["maybe", "2", " Tru "])
def test_a_bad_switch_value_is_refused(monkeypatch, value):
    """A value that is neither on nor off stops the tiled forward with one line naming it and the valid ones, rather
    than being read as one of them (a measurement of the other path, under the wrong name)."""
    monkeypatch.setenv(attn_mod.TMA_ENV, value)
    q, k, v = _case(1, 2, 2, 80, 80, 64, seed=6)  # above the decoding forward's rows: the tiled one
    with pytest.raises(ValueError) as err:
        api.qknorm_attn_func(q, k, v, scaling=0.1, softcap=4.0)
    assert str(err.value) == (
        f"HF_QKNORM_TMA={value!r} is not one of 0, off, false, no, 1, on, true, yes (or unset: the tile table decides)"
    )
    for good, want in (("", None), (" ON ", True), ("no", False)):
        monkeypatch.setenv(attn_mod.TMA_ENV, good)
        assert attn_mod.tma_requested() is want


def test_descriptor_scratch_puts_the_callers_allocator_back():
    from triton.runtime import _allocation

    if not attn_mod._tma_supported_here():
        pytest.skip("this Triton has no tensor descriptors in kernels")
    before = _allocation._allocator.get()
    with attn_mod._descriptor_scratch(torch.device("cpu")):
        buf = _allocation._allocator.get()(256, 128, None)
        assert buf.numel() == 256 and buf.dtype == torch.int8
    assert _allocation._allocator.get() is before


# --- what it computes -----------------------------------------------------------------------------------------


def _case(b, h, hkv, tq, tk, d, seed, tail=0):
    """Random fp32 q, k, v; with ``tail``, K and V are views of longer tensors whose extra rows are NaN, so a load
    that reads past the sequence (instead of zeros) poisons the output."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, tq, d, generator=g)
    k, v = (torch.randn(b, hkv, tk + tail, d, generator=g) for _ in "kv")
    for t in (k, v):
        t[:, :, tk:] = float("nan")
    return q.to(DEVICE), k[:, :, :tk].to(DEVICE), v[:, :, :tk].to(DEVICE)


def _close(got, ref):
    err = (got.double() - ref.double()).abs().max().item()
    assert err <= TOL * max(ref.abs().max().item(), 1.0), err


CASES = [
    # (b, h, hkv, tq, tk, d, causal, softcap, window, block_m, block_n)
    (2, 4, 2, 37, 37, 64, True, 5.0, None, 32, 32),
    (1, 2, 2, 33, 50, 32, True, None, None, 16, 32),  # q_len < kv_len: the diagonal shifted
    (1, 4, 1, 50, 20, 16, True, 30.0, None, 32, 16),  # q_len > kv_len: empty rows; MQA
    (1, 2, 1, 45, 45, 64, False, 2.0, None, 32, 32),
    (1, 2, 2, 70, 70, 32, True, None, 17, 16, 16),  # a window: its left edge is a masked loop too
    (1, 2, 2, 31, 31, 128, False, None, None, 16, 64),  # a key block longer than the sequence
]


@needs_descriptors
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_tma_forward_matches_reference(monkeypatch, launches, case):
    b, h, hkv, tq, tk, d, causal, softcap, window, bm, bn = case
    monkeypatch.setenv(attn_mod.TMA_ENV, "1")
    q, k, v = _case(b, h, hkv, tq, tk, d, seed=tq * tk + d, tail=16)
    kw = dict(scaling=d**-0.5, softcap=softcap, causal=causal, sliding_window=window)
    out, lse = attn_mod.attn_fwd(q, k, v, **kw, block_m=bm, block_n=bn, decode=False)
    assert launches == [_tma_here()]
    ref = attention_reference(q.double(), k.double(), v.double(), **kw)
    _close(out, ref)
    monkeypatch.setenv(attn_mod.TMA_ENV, "0")  # the pointer loads, for the LSE (the reference has none)
    out_ptr, lse_ptr = attn_mod.attn_fwd(q, k, v, **kw, block_m=bm, block_n=bn, decode=False)
    assert launches[-1] is False
    torch.testing.assert_close(out, out_ptr, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_ptr, rtol=1e-5, atol=1e-5)


@needs_descriptors
@pytest.mark.parametrize("causal", [True, False])
def test_tma_forward_feeds_the_backward(monkeypatch, launches, causal):
    """Training through the descriptor forward: the backward (pointer loads) starts from its output and LSE. Under
    the interpreter the two forwards round q.k differently (numpy multiplies a transposed K tile in another order),
    so the backward's recomputed logits no longer round exactly like the forward's: the gradients stay well within
    the fp32 tolerance, not bitwise equal to the pointer forward's."""
    monkeypatch.setenv(attn_mod.TMA_ENV, "1")
    q, k, v = _case(1, 4, 2, 45, 45, 64, seed=21, tail=8)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(22)).to(DEVICE)
    kw = dict(scaling=0.125, softcap=20.0, causal=causal)
    out, lse = attn_mod.attn_fwd(q, k, v, **kw, block_m=16, block_n=32, decode=False)
    assert launches == [_tma_here()]
    grads = attn_mod.attn_bwd(do, q, k, v, out, lse, **kw)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    attention_reference(*leaves, **kw).backward(do.double())
    for got, leaf in zip(grads, leaves):
        _close(got, leaf.grad)


@needs_descriptors
def test_tma_forward_from_the_table_with_mask_and_max_logits(monkeypatch, launches):
    """A table row with ``tma`` reaches the launch; a dense mask and the per-row max logits ride along."""
    monkeypatch.delenv(attn_mod.TMA_ENV, raising=False)
    arch = attn_mod._arch(torch.device(DEVICE), INTERPRETED)
    key = (arch, "fwd", 64, True, "float32")
    monkeypatch.setitem(_tile_table.TILES, key, dict(block_m=16, block_n=32, num_warps=4, num_stages=1, tma=True))
    q, k, v = _case(2, 2, 1, 40, 40, 64, seed=3, tail=8)
    mask = torch.rand(2, 1, 40, 40, generator=torch.Generator().manual_seed(4)).to(DEVICE) > 0.3
    kw = dict(scaling=0.125, softcap=8.0, causal=True)
    out, lse, row_max = attn_mod.attn_fwd(q, k, v, **kw, attn_mask=mask, decode=False, return_max=True)
    assert launches == [_tma_here()]
    _close(out, attention_reference(q.double(), k.double(), v.double(), **kw, mask=mask))
    ptr = attn_mod.attn_fwd(q, k, v, **kw, attn_mask=mask, decode=False, return_max=True)  # still the table's
    monkeypatch.setenv(attn_mod.TMA_ENV, "0")
    ptr = attn_mod.attn_fwd(q, k, v, **kw, attn_mask=mask, decode=False, return_max=True)
    assert launches[-1] is False
    torch.testing.assert_close(row_max, ptr[2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ptr[1], rtol=1e-5, atol=1e-5)


@needs_descriptors
def test_tma_forward_packed_sequences(monkeypatch, launches):
    """Each sequence's descriptors end at that sequence: the next one's keys (and NaN rows past the last) are
    never read."""
    monkeypatch.setenv(attn_mod.TMA_ENV, "1")
    lens = [5, 37, 19]
    total = sum(lens)
    q, k, v = _case(1, 4, 2, total + 3, total + 3, 32, seed=9)
    q[:, :, total:] = float("nan")
    k[:, :, total:] = float("nan")
    v[:, :, total:] = float("nan")
    cu = torch.tensor([0, 5, 42, 61], dtype=torch.int32, device=DEVICE)
    kw = dict(scaling=0.2, softcap=3.0, causal=True)
    out, _ = attn_mod.attn_fwd(q, k, v, **kw, cu_seqlens_q=cu, cu_seqlens_k=cu, block_m=16, block_n=16)
    assert launches == [_tma_here()]
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref = attention_reference(*(t[:, :, s:e].double() for t in (q, k, v)), **kw)
        _close(out[:, :, s:e], ref)
    assert (out[:, :, total:] == 0).all()


@needs_descriptors
def test_head_dim_80_falls_back_to_pointer_loads(monkeypatch, launches):
    monkeypatch.setenv(attn_mod.TMA_ENV, "1")
    q, k, v = _case(1, 2, 2, 20, 20, 80, seed=5)
    out, _ = attn_mod.attn_fwd(q, k, v, scaling=0.1, softcap=4.0, causal=True, decode=False)
    assert launches == [False]
    _close(out, attention_reference(q.double(), k.double(), v.double(), scaling=0.1, softcap=4.0, causal=True))


# --- it compiles for Hopper -------------------------------------------------------------------------------------

_COMPILE = textwrap.dedent(
    """
    import json, sys
    from unittest import mock
    import torch
    sys.path.insert(0, sys.argv[1])
    import compile_kernels as ck
    from hf_qknorm.kernels import attention
    for d in (64, 128):
        with mock.patch.object(attention, "_tma", lambda *a: True):  # what a Hopper GPU's launch asks for
            calls = ck.record_launches(dict(dtype=torch.bfloat16, head_dim=d, softcap=50.0, mask=True))
        for fn, args, kwargs in calls:
            if fn.__name__ == "_attn_fwd_kernel":
                row = ck.compile_launch(fn, args, kwargs, 90)
                print(json.dumps({**row, "TMA": kwargs["TMA"]}), flush=True)
    """
)


@pytest.mark.spawns
@pytest.mark.slow
def test_tma_forward_compiles_for_sm90():
    pytest.importorskip("triton.backends.nvidia", reason="this triton build has no NVIDIA backend")
    if not attn_mod._tma_supported_here():
        pytest.skip("this Triton has no tensor descriptors in kernels")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    res = subprocess.run(
        [sys.executable, "-c", _COMPILE, str(ROOT / "scripts")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
        check=False,
    )
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert res.returncode == 0 and len(rows) == 2, res.stderr[-3000:]
    for row in rows:
        assert row["TMA"] is True and row["ok"], row
        assert row.get("local_bytes", 0) == 0, f"register spills: {row}"


# --- the sweep measures it against the pointer loads --------------------------------------------------------------


def _sweep_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import sweep_tiles
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return sweep_tiles


def _sweep_object(capability=None, min_gain=0.0):
    sweep_tiles = _sweep_module()
    args = sweep_tiles.argparse.Namespace(dry_run=True, budget_s=60.0, reserve_s=1.0, min_gain=min_gain)
    s = sweep_tiles.Sweep(args)
    s.capability = capability
    return s


def test_sweep_tma_candidates_are_fwd_rows_with_tma():
    sweep_tiles = _sweep_module()
    assert "fwd-tma" in sweep_tiles.GRIDS and "fwd-tma" in sweep_tiles.DRY_GRIDS
    for tiles in sweep_tiles.GRIDS["fwd-tma"] + sweep_tiles.DRY_GRIDS["fwd-tma"]:
        direction, entry = sweep_tiles._entry("fwd-tma", tiles)
        assert direction == "fwd" and entry["tma"] is True
        _tile_table.check_entry(("sm90", direction, 128, True, "bfloat16"), entry)
    assert "tma" not in sweep_tiles._entry("fwd", (128, 64, 8, 3))[1]


def test_sweep_keeps_the_faster_forward_and_skips_tma_before_hopper():
    s = _sweep_object()
    key = ("sm90", "fwd", 128, True, "bfloat16")
    ptr, tma = dict(GOOD), {**GOOD, "tma": True}
    s.finish({"fwd": (2.0, key, ptr), "fwd-tma": (1.5, key, tma)}, 128, True, {})
    assert s.winners[key] == (1.5, tma)
    s.finish({"fwd": (1.0, key, ptr), "fwd-tma": (1.5, key, tma)}, 128, True, {})
    assert s.winners[key] == (1.0, ptr)
    q, k, v = _qkv(64)
    assert "compute capability 9.0" in _sweep_object(capability=(8, 0)).tma_unusable((q, k, v), {})
    if attn_mod._tma_supported_here() and INTERPRETED:
        assert s.tma_unusable((q, k, v), {}) is None
        assert "would not take" in s.tma_unusable(_qkv(80), {})


def test_sweep_apply_writes_the_tma_field(tmp_path):
    sweep_tiles = _sweep_module()
    table = tmp_path / "table.py"
    table.write_text(Path(_tile_table.__file__).read_text())
    row = {"key": ["sm90", "fwd", 128, True, "bfloat16"], "entry": {**GOOD, "tma": True}}
    result = tmp_path / "r.json"
    result.write_text(json.dumps(dict(arch="sm90", device="H100", date="2026-11-27", dry_run=False, tiles=[row])))
    assert sweep_tiles.apply(str(result), table) == 0
    assert '"tma": True' in table.read_text()
    namespace: dict = {}
    exec(compile(table.read_text(), str(table), "exec"), namespace)  # validated at import, like the package's
    assert namespace["TILES"] == {tuple(row["key"]): row["entry"]}


@needs_descriptors
@pytest.mark.spawns
@pytest.mark.slow
def test_sweep_dry_run_checks_and_times_tma_candidates(tmp_path):
    script = ROOT / "benchmarks" / "sweep_tiles.py"
    env = {k: v for k, v in os.environ.items() if k != attn_mod.TMA_ENV}
    res = subprocess.run(
        [sys.executable, str(script), "--dry-run", "--out", str(tmp_path), "--directions", "fwd", "fwd-tma"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
        check=False,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (jsonl,) = tmp_path.glob("*-tiles.jsonl")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    tma = [r for r in rows if r["direction"] == "fwd-tma"]
    assert tma and all(r["status"] == "ok" and r["max_rel_err"] < 1e-4 and not r["fallback"] for r in tma), rows
    work = {round(r["tflops"] * r["ms"], 12) for r in rows}  # the same forward's flops under either label
    assert len(work) == 1, rows
    (winner,) = json.loads(jsonl.with_suffix(".json").read_text())["tiles"]
    assert winner["key"][1] == "fwd"


def test_sweep_keeps_the_fallback_unless_a_candidate_beats_it_by_the_margin():
    """--min-gain: a candidate within the margin of the launch it would replace does not win (the H200's sweep of
    2026-11-30 put forward rows 1-4% ahead of the fallback that were slower in the attention benchmark); one past it
    does; "fwd-tma" is held to the pointer forward's fallback and "atomic" to the separate backward's."""
    s = _sweep_object(min_gain=0.05)
    fallback = (1.0, "key", {"tiles": 0})
    assert s.better("fwd", 128, True, 1.0, None, fallback=True)
    s.base_ms[("fwd", 128, True)] = 1.0
    assert not s.better("fwd", 128, True, 0.96, fallback)  # 4% faster: within the spread
    assert s.better("fwd", 128, True, 0.94, fallback)
    assert not s.better("fwd", 128, True, 0.94, (0.93, "key", {}))  # past the margin, but not the fastest
    assert not s.better("fwd-tma", 128, True, 0.97, None)  # no TMA row unless it beats the pointer fallback
    assert s.better("fwd-tma", 128, True, 0.90, None)
    s.base_ms[("dkdv", 128, True)] = 2.8
    assert not s.better("atomic", 128, True, 2.7, None) and s.better("atomic", 128, True, 2.5, None)
    assert s.better("decode", 64, True, 0.5, None)  # its fallback has no time (failed or not reached): fastest wins
    assert _sweep_object(min_gain=0.0).better("fwd", 64, True, 0.99, fallback)


def test_sweep_refuses_a_margin_outside_zero_to_one():
    sweep_tiles = _sweep_module()
    for bad in ("-0.1", "1", "2"):
        with pytest.raises(SystemExit):
            sweep_tiles.main(["--min-gain", bad])

"""The frozen tile table (hf_qknorm/kernels/_tile_table.py): validation, lookup, fallback, and that an entry reaches
the launch (under the interpreter, the "interpreter" arch key)."""

from __future__ import annotations

import math
import os

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from hf_qknorm.kernels import _tile_table  # noqa: E402
from hf_qknorm.kernels import attention as attn_mod  # noqa: E402
from hf_qknorm.kernels._common import is_interpreted  # noqa: E402
from hf_qknorm.reference import attention_reference  # noqa: E402

INTERPRETED = is_interpreted(attn_mod._attn_fwd_kernel)
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

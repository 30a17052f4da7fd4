"""Delegation of capped calls to FlashAttention (hf_qknorm/attention/delegate.py): the fit predicate case by case, the
table and its validation, the policy setting, the argument mapping checked numerically against the float64
reference through a fake ``flash_attn`` whose functions compute FlashAttention's documented semantics in float64
from their own arguments, the routing through the ``"qknorm"`` backend (device check injected, so it runs on a CPU),
what ``hf-qknorm info`` says, the script that turns measured rows into table entries, and -- where the real package
and a GPU exist -- the real package against the reference."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import threading
import types
from pathlib import Path

import pytest
import torch

from hf_qknorm.attention import KernelPolicy, current_kernel_policy, delegate, interface, kernel_policy
from hf_qknorm.reference import attention_reference

ROOT = Path(__file__).resolve().parents[2]
COMMITTED_ROWS = ROOT / "benchmarks" / "results" / "gpu" / "2026-11-23-h100-attn.jsonl"
HOPPER = (9, 0)


def _fa_semantics(q, k, v, softmax_scale, causal, window_size, softcap):
    """FlashAttention's documented computation, in float64: (batch, seq, heads, dim) layout, ``softmax_scale=None``
    = dim**-0.5, ``softcap * tanh(s / softcap)`` for softcap > 0, causal and windows aligned bottom-right, query i
    seeing keys in [i + sk - sq - left, i + sk - sq + right] inclusive (-1 = unbounded; causal sets right = 0),
    rows with no key give 0."""
    assert q.dim() == 4 and k.shape == v.shape and q.shape[-1] == k.shape[-1] and q.shape[2] % k.shape[2] == 0
    sq, h, d = q.shape[1], q.shape[2], q.shape[3]
    sk, hk = k.shape[1], k.shape[2]
    qd, kd, vd = q.double(), k.double().repeat_interleave(h // hk, 2), v.double().repeat_interleave(h // hk, 2)
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    left, right = window_size
    right = 0 if causal else right
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    p = torch.softmax(s.masked_fill(~ok, float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, vd).to(q.dtype)


def _fake_fa2(version="2.8.3"):
    calls = []

    def flash_attn_func(
        q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
        alibi_slopes=None, deterministic=False, return_attn_probs=False,
    ):  # fmt: skip
        assert dropout_p == 0.0 and alibi_slopes is None and not return_attn_probs
        calls.append(dict(causal=causal, window_size=window_size, softcap=softcap, scale=softmax_scale))
        return _fa_semantics(q, k, v, softmax_scale, causal, window_size, softcap)

    def flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
        causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
        return_attn_probs=False, block_table=None,
    ):  # fmt: skip
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32 and q.dim() == 3
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        assert max_seqlen_q == max(b - a for a, b in zip(cq, cq[1:]))
        assert max_seqlen_k == max(b - a for a, b in zip(ck, ck[1:]))
        calls.append(dict(causal=causal, window_size=window_size, softcap=softcap, varlen=True))
        outs = [
            _fa_semantics(q[None, a:b], k[None, c:e], v[None, c:e], softmax_scale, causal, window_size, softcap)[0]
            for a, b, c, e in zip(cq, cq[1:], ck, ck[1:])
        ]
        return torch.cat(outs, 0)

    module = types.ModuleType("flash_attn")
    module.__version__ = version
    module.flash_attn_func, module.flash_attn_varlen_func, module.calls = flash_attn_func, flash_attn_varlen_func, calls
    return module


def _fake_fa3():
    calls = []

    def flash_attn_func(
        q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
        window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False,
        sm_margin=0, return_attn_probs=False,
    ):  # fmt: skip
        calls.append(dict(causal=causal, window_size=window_size, softcap=softcap))
        out = _fa_semantics(q, k, v, softmax_scale, causal, window_size, softcap)
        return out, torch.zeros(())  # the releases that return (out, lse)

    module = types.ModuleType("flash_attn_interface")
    module.__version__ = "3.0.0b1"
    module.flash_attn_func, module.calls = flash_attn_func, calls
    return module


@pytest.fixture
def installed(monkeypatch):
    """Install fake packages: ``installed(fa2=..., fa3=...)`` (None hides the real one too)."""

    def install(fa2=None, fa3=None):
        monkeypatch.setitem(sys.modules, "flash_attn", fa2)
        monkeypatch.setitem(sys.modules, "flash_attn_interface", fa3)
        delegate.load.cache_clear()
        return fa2 if fa3 is None else fa3

    monkeypatch.setattr(delegate, "_warned", set())
    yield install
    delegate.load.cache_clear()


@pytest.fixture
def on_hopper(monkeypatch):
    """The device check injected: every tensor is on a compute capability 9.0 card."""
    monkeypatch.setattr(delegate, "device_capability", lambda device: HOPPER)


# --- the fit predicate, case by case ---------------------------------------------------------------------------

FITS = dict(
    route="flash_attn", capability=HOPPER, dtype=torch.bfloat16, head_dim=128, heads=8, kv_heads=2, softcap=30.0,
    masked=False,
)  # fmt: skip


def _why(**change):
    args = {**FITS, **change}
    route, cap, dtype, hd, h, hk = (
        args.pop(k) for k in ("route", "capability", "dtype", "head_dim", "heads", "kv_heads")
    )
    return delegate.why_not(route, cap, dtype, hd, h, hk, **args)


def test_a_fitting_call_fits_both_routes():
    assert _why() is None
    assert _why(dtype=torch.float16, head_dim=64, heads=4, kv_heads=4) is None
    assert _why(route="flash_attn_interface") is None
    assert _why(capability=(8, 0)) is None and _why(capability=(10, 0)) is None  # FA2 runs on Ampere and later


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(capability=None), "not on a CUDA device"),
        (dict(capability=(7, 5)), "compute capability 7.5"),
        (
            dict(route="flash_attn_interface", capability=(8, 0)),
            "FlashAttention 3 does not run on compute capability 8.0",
        ),
        (dict(dtype=torch.float32), "not torch.float32"),
        (dict(dtype=torch.float64), "not torch.float64"),
        (dict(head_dim=80 + 4), "head_dim 84"),
        (dict(head_dim=512), "head_dim 512"),
        (dict(heads=6, kv_heads=4), "do not group"),
        (dict(softcap=None), "no cap"),
        (dict(masked=True), "dense mask"),
        (dict(dropout=0.1), "dropout 0.1"),
        (dict(sink=True), "attention sinks"),
        (dict(want_max=True), "max logits"),
        (dict(weights=True), "attention weights"),
    ],
)
def test_a_call_that_does_not_fit_is_refused_with_its_reason(change, words):
    assert words in _why(**change)


# --- the table ---------------------------------------------------------------------------------------------------

ENTRY = {"route": "flash_attn", "version": "2.8.3", "speedup": 1.4}


def test_committed_table_is_valid():
    delegate.check_table(delegate.WINS)
    assert set(delegate.SOURCES) == {key[0] for key in delegate.WINS}


@pytest.mark.parametrize(
    "key, entry, words",
    [
        (("sm90", 128), ENTRY, "expected the key (arch, head_dim, causal)"),
        (("hopper", 128, True), ENTRY, "arch 'hopper'"),
        (("sm90", 0, True), ENTRY, "head_dim 0"),
        (("sm90", 128, 1), ENTRY, "causal 1"),
        (("sm90", 128, True), {**ENTRY, "dtype": "bf16"}, "exactly 'route', 'version' and 'speedup'"),
        (("sm90", 128, True), {**ENTRY, "route": "xformers"}, "route 'xformers'"),
        (("sm90", 128, True), {**ENTRY, "version": 2.8}, "version 2.8"),
        (("sm90", 128, True), {**ENTRY, "speedup": 0.9}, "speedup 0.9 is not above 1"),
    ],
)
def test_bad_table_entries_are_named_in_one_line(key, entry, words):
    with pytest.raises(ValueError, match=None) as info:
        delegate.check_entry(key, entry)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_auto_takes_only_measured_entries_whose_package_is_installed(installed):
    table = {("sm90", 128, True): ENTRY}
    installed(fa2=None)
    assert delegate.choose("auto", HOPPER, 128, True, table) is None  # measured, but not installed here
    installed(fa2=_fake_fa2())
    assert delegate.choose("auto", HOPPER, 128, True, table) == "flash_attn"
    assert delegate.choose("auto", HOPPER, 128, False, table) is None  # not measured non-causal
    assert delegate.choose("auto", HOPPER, 64, True, table) is None
    assert delegate.choose("auto", (8, 0), 128, True, table) is None  # another card
    assert delegate.choose("auto", HOPPER, 128, True) is None  # the committed table: nothing measured yet
    assert delegate.choose("off", HOPPER, 128, True, table) is None
    assert delegate.choose("auto", None, 128, True, table) is None


def test_on_prefers_fa3_on_hopper_and_fa2_elsewhere(installed):
    installed(fa2=_fake_fa2(), fa3=_fake_fa3())
    assert delegate.choose("on", HOPPER, 96, False) == "flash_attn_interface"
    assert delegate.choose("on", (8, 0), 96, False) == "flash_attn"
    installed(fa2=None, fa3=None)
    assert delegate.choose("on", HOPPER, 96, False) is None


def test_fa2_older_than_2_6_has_no_softcap_and_is_not_used(installed):
    installed(fa2=_fake_fa2(version="2.5.9"))
    module, version, reason = delegate.load("flash_attn")
    assert module is None and "2.5.9 has no softcap" in reason
    assert delegate.installed() == {}


# --- the policy setting --------------------------------------------------------------------------------------------


def test_policy_setting_defaults_to_auto_nests_and_names_the_choices():
    assert current_kernel_policy().flash_attn == "auto"
    with kernel_policy(flash_attn="off") as outer:
        assert outer == KernelPolicy(flash_attn="off")
        with kernel_policy(use_fallback=False) as inner:  # kept from the enclosing block
            assert inner.flash_attn == "off"
        seen = []
        thread = threading.Thread(target=lambda: seen.append(current_kernel_policy().flash_attn))
        thread.start()
        thread.join()
        assert seen == ["auto"]  # another thread keeps its own policy
    assert current_kernel_policy().flash_attn == "auto"
    with pytest.raises(ValueError, match=r"flash_attn must be one of 'auto', 'on', 'off', got 'yes'"):
        with kernel_policy(flash_attn="yes"):
            pass
    with pytest.raises(ValueError, match="got True"):
        KernelPolicy(flash_attn=True)


# --- the argument mapping, numerically (the adapter called directly, on the CPU) ------------------------------------

CASES = [  # (batch, heads, kv_heads, q_len, kv_len, head_dim, causal, sliding_window, softcap, scaling)
    (2, 4, 2, 17, 17, 16, True, None, 5.0, 0.3),
    (1, 4, 4, 5, 23, 16, True, None, 2.0, 0.25),  # a query block at the end of a longer key range: bottom-right
    (2, 2, 1, 33, 33, 8, True, 7, 4.0, 0.35),  # window: keys with pos_q - pos_k < 7
    (1, 3, 3, 9, 21, 8, True, 4, 3.0, 0.5),
    (2, 4, 2, 13, 13, 16, False, None, 1.5, 0.3),
    (1, 2, 2, 11, 11, 8, False, 3, 6.0, 0.4),  # a window without causality reaches every later key
]


def _inputs(batch, heads, kv_heads, q_len, kv_len, head_dim, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, head_dim, generator=g, dtype=torch.float64) * 3
    k = torch.randn(batch, kv_heads, kv_len, head_dim, generator=g, dtype=torch.float64) * 3
    v = torch.randn(batch, kv_heads, kv_len, head_dim, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize("route", ["flash_attn", "flash_attn_interface"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_the_adapter_computes_the_reference_and_its_gradients(case, route, installed):
    installed(fa2=_fake_fa2(), fa3=_fake_fa3() if route == "flash_attn_interface" else None)
    *shape, causal, window, cap, scaling = case
    q, k, v = _inputs(*shape)
    out = delegate.flash_attention(
        route, q, k, v, scaling=scaling, softcap=cap, causal=causal, sliding_window=window
    ).transpose(1, 2)
    ref = attention_reference(q, k, v, scaling=scaling, softcap=cap, causal=causal, sliding_window=window)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    do = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    # the cap really engages: an uncapped answer differs
    assert not torch.allclose(ref, attention_reference(q, k, v, scaling=scaling, causal=causal, sliding_window=window))


def test_window_size_is_inclusive_on_both_sides():
    assert delegate.window_size(None, True) == (-1, 0)
    assert delegate.window_size(None, False) == (-1, -1)
    assert delegate.window_size(4096, True) == (4095, 0)
    assert delegate.window_size(1, False) == (0, -1)


def test_the_varlen_adapter_computes_each_packed_sequence(installed):
    installed(fa2=_fake_fa2())
    lengths = [5, 11, 1, 8]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])  # int64: the adapter makes it int32
    q, k, v = _inputs(1, 4, 2, sum(lengths), sum(lengths), 16)
    out = delegate.flash_attention(
        "flash_attn", q, k, v, scaling=0.3, softcap=4.0, causal=True, sliding_window=3, cu_seqlens_q=cu,
        cu_seqlens_k=cu,
    )  # fmt: skip
    assert out.shape == (1, sum(lengths), 4, 16)
    for a, b in zip(cu.tolist(), cu.tolist()[1:]):
        part = [t[:, :, a:b] for t in (q, k, v)]
        ref = attention_reference(*part, scaling=0.3, softcap=4.0, causal=True, sliding_window=3)
        torch.testing.assert_close(out[:, a:b].transpose(1, 2), ref, atol=1e-10, rtol=1e-10)


# --- the routing through the backend (the device check injected) ----------------------------------------------------


class _Attn(torch.nn.Module):
    is_causal = True


@pytest.fixture
def backend(monkeypatch, on_hopper):
    """The backend as on a GPU where the kernels run: ``_use_kernels`` says yes, and the kernels' entry is a spy
    returning the reference (so a call that stays on the kernels is recorded, not interpreted)."""
    kernel_calls = []

    def kernels(query, key, value, mask, cu_q, cu_k, scaling, softcap, causal, sliding_window, want_max, kwargs):
        kernel_calls.append(1)
        out = attention_reference(query, key, value, scaling=scaling, softcap=softcap, causal=causal, mask=mask)
        return out.to(query.dtype), (torch.zeros(query.shape[1]) if want_max else None)

    monkeypatch.setattr(interface, "_use_kernels", lambda *a, **kw: True)
    monkeypatch.setattr(interface, "_kernel_attention", kernels)
    monkeypatch.setattr(delegate, "CALLS", type(delegate.CALLS)())
    return kernel_calls


def _call(dtype=torch.bfloat16, mask=None, module=None, **kwargs):
    q, k, v = _inputs(2, 4, 2, 12, 12, 16, dtype=dtype)
    out, _ = interface.qknorm_attention_forward(
        module or _Attn().train(), q, k, v, mask, scaling=0.25, softcap=4.0, **kwargs
    )
    return out, (q, k, v)


def test_auto_delegates_a_measured_case_and_counts_it(backend, installed, monkeypatch):
    fake = installed(fa2=_fake_fa2())
    _call()
    assert backend == [1] and fake.calls == []  # nothing measured: the kernels
    monkeypatch.setitem(delegate.WINS, ("sm90", 16, True), ENTRY)
    out, (q, k, v) = _call()
    assert backend == [1] and len(fake.calls) == 1 and delegate.delegated_calls() == {"flash_attn": 1}
    assert fake.calls[0] == dict(causal=True, window_size=(-1, 0), softcap=4.0, scale=0.25)
    ref = attention_reference(*(t.double() for t in (q, k, v)), scaling=0.25, softcap=4.0, causal=True)
    torch.testing.assert_close(out.transpose(1, 2).double(), ref, atol=2e-2, rtol=2e-2)  # bfloat16 in and out
    out.float().square().sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))  # gradients flow
    with kernel_policy(flash_attn="off"):
        _call()
    assert backend == [1, 1] and len(fake.calls) == 1


def test_on_delegates_every_fitting_call_and_off_none(backend, installed):
    fake = installed(fa2=_fake_fa2())
    with kernel_policy(flash_attn="on"):
        _call()
        _call(dtype=torch.float16)
        assert len(fake.calls) == 2 and backend == []
        _call(dtype=torch.float32)  # not a FlashAttention dtype: the kernels
        _call(mask=torch.ones(2, 1, 12, 12, dtype=torch.bool).tril())  # a dense mask: the kernels
        assert len(fake.calls) == 2 and len(backend) == 2
    with kernel_policy(flash_attn="off"):
        _call()
    assert len(fake.calls) == 2 and len(backend) == 3


def test_a_max_logits_probe_keeps_the_kernels(backend, installed):
    fake = installed(fa2=_fake_fa2())
    module = _Attn().train()
    seen = []

    def probe(module, query, key, **kw):
        seen.append(kw["max_logits"])

    probe.wants_max_logits = True
    module._qknorm_probes = {"p": probe}
    with kernel_policy(flash_attn="on"):
        _call(module=module)
    assert fake.calls == [] and backend == [1] and seen[0] is not None


def test_packed_sequences_go_to_the_varlen_function(backend, installed):
    fake = installed(fa2=_fake_fa2())
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q, k, v = _inputs(1, 4, 2, 12, 12, 16, dtype=torch.bfloat16)
    with kernel_policy(flash_attn="on"):
        out, _ = interface.qknorm_attention_forward(
            _Attn().train(), q, k, v, None, scaling=0.25, softcap=4.0, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
            max_length_q=7, max_length_k=7,
        )  # fmt: skip
    assert fake.calls[0]["varlen"] and backend == []
    for a, b in ((0, 5), (5, 12)):
        part = [t[:, :, a:b].double() for t in (q, k, v)]
        ref = attention_reference(*part, scaling=0.25, softcap=4.0, causal=True)
        torch.testing.assert_close(out[:, a:b].transpose(1, 2).double(), ref, atol=2e-2, rtol=2e-2)


def test_a_compiled_call_is_delegated_in_one_graph(installed, on_hopper):
    fake = installed(fa2=_fake_fa2())
    q, k, v = _inputs(2, 4, 2, 12, 12, 16, dtype=torch.bfloat16)

    def attend(q, k, v):
        return delegate.try_delegate(q, k, v, None, None, None, 0.25, 4.0, True, 5, False, {})

    with kernel_policy(flash_attn="on"):
        out = torch.compile(attend, fullgraph=True, backend="eager")(q, k, v)
    assert len(fake.calls) == 1 and fake.calls[0]["window_size"] == (4, 0)
    ref = attention_reference(
        *(t.double() for t in (q, k, v)), scaling=0.25, softcap=4.0, causal=True, sliding_window=5
    )
    torch.testing.assert_close(out.transpose(1, 2).double(), ref, atol=2e-2, rtol=2e-2)


def test_on_without_a_package_warns_once_and_runs_the_kernels(backend, installed, caplog):
    installed(fa2=None, fa3=None)
    with kernel_policy(flash_attn="on"), caplog.at_level("WARNING", logger=delegate.__name__):
        _call()
        _call()
    assert len(backend) == 2
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "no FlashAttention to delegate to (flash_attn is not installed" in caplog.records[0].getMessage()


# --- what is visible -----------------------------------------------------------------------------------------------


def test_info_names_the_package_and_whether_delegation_is_active(installed, on_hopper, monkeypatch, capsys):
    from hf_qknorm.cli.main import main

    installed(fa2=None, fa3=None)
    package, state = delegate.describe(torch.device("cpu"))
    assert "flash_attn is not installed" in package and "inactive on sm90" in state
    installed(fa2=_fake_fa2())
    monkeypatch.setitem(delegate.WINS, ("sm90", 128, True), ENTRY)
    monkeypatch.setitem(delegate.SOURCES, "sm90", "NVIDIA H100 80GB HBM3, 2026-12-01")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "flash-attn:     flash_attn 2.8.3 (FlashAttention 2)" in out
    assert "delegation:     active on sm90 for capped calls of head_dim 128 causal (1.4x)" in out
    with kernel_policy(flash_attn="off"):
        assert delegate.describe(torch.device("cpu"))[1].startswith("off")
    monkeypatch.setattr(delegate, "device_capability", lambda device: None)
    assert delegate.describe(torch.device("cpu"))[1].startswith("inactive: no CUDA device")


# --- the script that fills the table ----------------------------------------------------------------------------------


def _script():
    spec = importlib.util.spec_from_file_location("delegation_table", ROOT / "benchmarks" / "delegation_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flash_rows(rows, ratio, slower_at=None):
    """flash-cap rows for the committed qknorm-triton rows, ``ratio`` times faster (slower at one seq_len)."""
    out = []
    for row in rows:
        if row["provider"] == "qknorm-triton" and "ms" in row:
            r = ratio if row["seq_len"] != slower_at else 0.9
            out.append({**row, "provider": "flash-cap", "flash_attn": "2.8.3", "ms": row["ms"] / r})
    return out


def test_the_committed_rows_measure_nothing_and_leave_the_table_empty():
    script = _script()
    table, measured, _ = script.wins(script.read_rows([COMMITTED_ROWS]))
    assert table == {} and measured == set()  # flash-attn was not installed on that run


def test_rows_become_entries_only_where_flash_attention_wins_everywhere(tmp_path, capsys):
    script = _script()
    rows = script.read_rows([COMMITTED_ROWS])
    lengths = sorted({r["seq_len"] for r in rows if r["provider"] == "qknorm-triton"})
    faster = rows + _flash_rows(rows, 1.5)
    table, measured, sources = script.wins(faster)
    assert measured == {("sm90", 64, True), ("sm90", 128, True)}
    assert table[("sm90", 128, True)] == {"route": "flash_attn", "version": "2.8.3", "speedup": 1.5}
    assert sources["sm90"].startswith("NVIDIA H100 80GB HBM3, 2026-11-23")
    table, measured, _ = script.wins(rows + _flash_rows(rows, 1.5, slower_at=lengths[-1]))
    assert table == {} and len(measured) == 2  # slower at one length: our kernel everywhere
    assert script.wins(faster, min_speedup=1.6)[0] == {}

    # --apply rewrites a copy of the module; the written table imports and validates
    target = tmp_path / "delegate.py"
    shutil.copy(ROOT / "hf_qknorm" / "attention" / "delegate.py", target)
    (tmp_path / "dispatch.py").write_text("_POLICY = None\n")
    result = tmp_path / "run.jsonl"
    result.write_text("".join(json.dumps(r) + "\n" for r in faster))
    assert script.main([str(result), "--apply", "--table", str(target)]) == 0
    assert "sm90 head_dim 128     causal: delegate to flash_attn (1.5x)" in capsys.readouterr().out
    written = script.load_table(target)
    assert written.WINS[("sm90", 64, True)]["speedup"] == 1.5 and "run.jsonl" in written.SOURCES["sm90"]
    result.write_text("".join(json.dumps(r) + "\n" for r in rows + _flash_rows(rows, 1.5, slower_at=lengths[0])))
    assert script.main([str(result), "--apply", "--table", str(target)]) == 0
    written = script.load_table(target)
    assert written.WINS == {} and written.SOURCES == {}  # measured again and lost: removed


# --- the real package, where it is installed -------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("causal, window", [(True, None), (True, 64), (False, None)])
def test_the_installed_flash_attn_computes_the_reference(causal, window):
    pytest.importorskip("flash_attn")
    delegate.load.cache_clear()
    if delegate.load("flash_attn")[0] is None:
        pytest.skip(delegate.load("flash_attn")[2])
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (2, 8, 2, 257, 257, 128)
    q, k, v = (
        (torch.randn(*s, device="cuda", generator=g) * m).to(torch.bfloat16).requires_grad_()
        for s, m in ((shape[:2] + shape[3:4] + shape[5:], 4.0), ((2, 2, 257, 128), 4.0), ((2, 2, 257, 128), 1.0))
    )
    args = dict(scaling=128**-0.5, softcap=30.0, causal=causal, sliding_window=window)
    out = delegate.flash_attention("flash_attn", q, k, v, **args).transpose(1, 2)
    ref64 = attention_reference(*(t.double() for t in (q, k, v)), **args)
    ref16 = attention_reference(q, k, v, **args)  # the same-dtype reference's own error sets the bar
    err, bar = (out.double() - ref64).abs().max(), (ref16.double() - ref64).abs().max()
    assert err <= 3 * bar + 1e-3, (err, bar)
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), do)
    want64 = torch.autograd.grad(ref64, (q, k, v), do.double(), allow_unused=True)
    want16 = torch.autograd.grad(ref16, (q, k, v), do)
    for a, b64, b16 in zip(got, want64, want16):
        assert (a.double() - b64).abs().max() <= 3 * (b16.double() - b64).abs().max() + 1e-3


@pytest.mark.cuda
def test_the_backend_delegates_to_the_installed_package_on_request():
    pytest.importorskip("flash_attn")
    delegate.load.cache_clear()
    if not delegate.installed():
        pytest.skip("; ".join(delegate.load(route)[2] for route in delegate.ROUTES))
    g = torch.Generator(device="cuda").manual_seed(1)
    q = (torch.randn(2, 8, 300, 128, device="cuda", generator=g) * 4).to(torch.bfloat16).requires_grad_()
    k = (torch.randn(2, 2, 300, 128, device="cuda", generator=g) * 4).to(torch.bfloat16).requires_grad_()
    v = torch.randn(2, 2, 300, 128, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    before = sum(delegate.delegated_calls().values())
    with kernel_policy(flash_attn="on", use_fallback=False):
        out, _ = interface.qknorm_attention_forward(_Attn().train(), q, k, v, None, scaling=0.1, softcap=20.0)
    assert sum(delegate.delegated_calls().values()) == before + 1  # what ran is counted
    args = dict(scaling=0.1, softcap=20.0, causal=True)
    ref64 = attention_reference(*(t.double() for t in (q, k, v)), **args)
    ref16 = attention_reference(q, k, v, **args)
    err, bar = (out.transpose(1, 2).double() - ref64).abs().max(), (ref16.double() - ref64).abs().max()
    assert err <= 3 * bar + 1e-3, (err, bar)
    out.float().square().sum().backward()
    assert all(torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0 for t in (q, k, v))

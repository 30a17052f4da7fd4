"""The lean decode path (hf_qknorm/attention/lean.py): a few queries, no gradient, plain tensor math.

Its calls are checked against :func:`hf_qknorm.reference.attention_reference` in float64 -- as unit calls (masks,
windows, GQA, sinks, dtypes, rows with no key) and as the calls real generation makes with every cache kind (the
inputs each cache hands the attention, recorded during ``generate``)."""

from __future__ import annotations

import types

import pytest
import torch

import hf_qknorm
from hf_qknorm.attention import interface, lean
from hf_qknorm.reference import allowed_reference, attention_reference
from tests._support.tiny_models import VOCAB, tiny_model


def _reference(q, k, v, *, scaling, softcap, mask, causal, window, sink=None):
    q, k, v = q.double(), k.double(), v.double()
    if sink is None:
        return attention_reference(
            q, k, v, scaling=scaling, softcap=softcap, causal=causal, mask=mask, sliding_window=window
        )
    groups = q.shape[1] // k.shape[1]
    s = scaling * (q @ k.repeat_interleave(groups, 1).transpose(-1, -2))
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    ok = allowed_reference(q.shape[2], k.shape[2], causal=causal, sliding_window=window, mask=mask)
    s = s.masked_fill(~ok, float("-inf"))
    column = sink.double().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    return torch.softmax(torch.cat([s, column], -1), -1)[..., :-1] @ v.repeat_interleave(groups, 1)


CASES = [
    # (batch, heads, kv_heads, q_len, kv_len, mask kind, causal, window)
    (1, 4, 2, 1, 37, None, False, None),  # decoding, dynamic cache: no mask
    (3, 4, 4, 1, 20, "batch", False, None),  # padding / a static cache's empty slots
    (2, 6, 2, 1, 30, None, False, 7),  # a window with no mask
    (2, 4, 1, 3, 19, "heads", False, None),  # a per-head mask, several queries
    (2, 4, 2, 5, 5, None, True, None),  # a short prefill: square causal
    (2, 4, 2, 4, 12, None, True, 5),  # speculative verification: bottom-right causal with a window
    (2, 4, 2, 2, 9, "empty_row", False, None),  # a row with no allowed key gives zeros
    # from lean.EXPM1_TANH_MIN logits on, the cap's tanh goes through expm1
    (4, 8, 2, 1, 160, "batch", False, None),  # batched decoding with padding: 5,120 logits
    (2, 8, 4, 4, 300, None, True, 64),  # speculative verification with a window: 19,200 logits
    (2, 4, 2, 2, 600, "empty_row", False, None),  # 9,600 logits, one row with no allowed key
]


def _mask(kind, b, h, q_len, kv_len, g):
    if kind is None:
        return None
    if kind == "batch":
        m = torch.rand(b, 1, 1, kv_len, generator=g) > 0.3
        m[..., -1] = True
        return m.expand(b, 1, q_len, kv_len)
    if kind == "heads":
        m = torch.rand(b, h, q_len, kv_len, generator=g) > 0.3
        m[..., 0] = True
        return m
    m = torch.ones(b, 1, q_len, kv_len, dtype=torch.bool)
    m[0, 0, 1] = False
    return m


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("with_sink", [False, True])
def test_lean_attention_float64(case, softcap, with_sink):
    b, h, hkv, tq, tk, kind, causal, window = case
    g = torch.Generator().manual_seed(CASES.index(case))
    q = torch.randn(b, h, tq, 16, generator=g, dtype=torch.float64) * 3
    k = torch.randn(b, hkv, tk, 16, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, tk, 16, generator=g, dtype=torch.float64)
    mask = _mask(kind, b, h, tq, tk, g)
    sink = torch.randn(h, generator=g, dtype=torch.float64) * 2 if with_sink else None
    got = lean.lean_attention(
        q, k, v, scaling=0.3, softcap=softcap, mask=mask, causal=causal, sliding_window=window, sink=sink
    )
    want = _reference(q, k, v, scaling=0.3, softcap=softcap, mask=mask, causal=causal, window=window, sink=sink)
    assert got.shape == (b, tq, h, 16)
    torch.testing.assert_close(got.transpose(1, 2), want, rtol=1e-12, atol=1e-12)
    if kind == "empty_row":
        assert torch.equal(got[0, 1], torch.zeros_like(got[0, 1]))


@pytest.mark.parametrize(
    "device, dtype",
    [
        ("cpu", torch.float32),
        ("cpu", torch.bfloat16),
        pytest.param("cuda", torch.float32, marks=pytest.mark.cuda),
        pytest.param("cuda", torch.bfloat16, marks=pytest.mark.cuda),
        pytest.param("cuda", torch.float16, marks=pytest.mark.cuda),
    ],
)
@pytest.mark.parametrize("softcap", [None, 2.0, 50.0])
@pytest.mark.parametrize("kv_len", [50, 600])  # 600: past lean.EXPM1_TANH_MIN logits, the cap's expm1 form
def test_lean_attention_low_precision(device, dtype, softcap, kv_len):
    """Half precision accumulates in float32: its error against float64 stays within 2x (3x capped) the error of
    the same-dtype plain computation (flash-attention's rule), plus a small atol. On CUDA, half-precision logits
    come from one ``bmm`` with a float32 result (:func:`hf_qknorm.attention.lean._half_logits`)."""
    g = torch.Generator().manual_seed(5)
    q = (torch.randn(2, 4, 1, 32, generator=g) * 3).to(device, dtype)
    k = torch.randn(2, 2, kv_len, 32, generator=g).to(device, dtype)
    v = torch.randn(2, 2, kv_len, 32, generator=g).to(device, dtype)
    mask = (torch.rand(2, 1, 1, kv_len, generator=g) > 0.2).to(device)
    want = _reference(q, k, v, scaling=0.25, softcap=softcap, mask=mask, causal=False, window=None)
    got = lean.lean_attention(q, k, v, scaling=0.25, softcap=softcap, mask=mask, causal=False, sliding_window=None)
    assert got.dtype == dtype
    plain = attention_reference(q, k, v, scaling=0.25, softcap=softcap, causal=False, mask=mask)
    base = (plain.double() - want).abs().max().item()
    err = (got.transpose(1, 2).double() - want).abs().max().item()
    assert err <= (3 if softcap else 2) * base + 1e-5, (err, base)
    if device == "cuda" and dtype != torch.float32:
        assert lean._BMM_OUT_DTYPE[0], "this torch refused bmm(out_dtype=float32) on CUDA: the casts were taken"


def test_half_logits_step_aside_where_bmm_refuses_out_dtype(monkeypatch):
    """Where ``bmm`` refuses ``out_dtype`` (every CPU, an older torch), the first call says so and every later call
    takes the casts: the same values, no error."""
    monkeypatch.setattr(lean, "_BMM_OUT_DTYPE", [True])
    q, k = torch.randn(2, 3, 8, dtype=torch.bfloat16), torch.randn(2, 5, 8, dtype=torch.bfloat16)
    assert lean._half_logits(q, k) is None and lean._BMM_OUT_DTYPE == [False]
    # a CUDA tensor that cannot take the route is sent down the casts by lean_attention, to the same result
    monkeypatch.setattr(lean, "_half_logits", lambda q, k: pytest.fail("called once the route was refused"))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    query, key, value = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    args = dict(scaling=0.3, softcap=2.0, mask=None, causal=False, sliding_window=None)
    got = lean.lean_attention(query.bfloat16(), key.bfloat16(), value.bfloat16(), **args)
    want = lean.lean_attention(query.bfloat16().float(), key.bfloat16().float(), value.bfloat16().float(), **args)
    assert torch.equal(got, want.bfloat16())


@pytest.mark.parametrize("kv_len", [20, 700])  # below and above lean.EXPM1_TANH_MIN logits
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lean_cap_saturates_without_nan(kv_len, dtype):
    """Logits far past the cap (2 s / c beyond the expm1 clamp, and beyond float32's exp range) give the capped
    value exactly, not NaN or inf, on both of the cap's forms."""
    assert (2 * 4 * 1 * kv_len >= lean.EXPM1_TANH_MIN) == (kv_len == 700)
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, 1, 16, generator=g, dtype=torch.float64) * 1e3
    k = torch.randn(2, 2, kv_len, 16, generator=g, dtype=torch.float64) * 1e2
    v = torch.randn(2, 2, kv_len, 16, generator=g, dtype=torch.float64)
    want = _reference(q, k, v, scaling=0.25, softcap=5.0, mask=None, causal=False, window=None)
    got = lean.lean_attention(
        q.to(dtype), k.to(dtype), v.to(dtype), scaling=0.25, softcap=5.0, mask=None, causal=False, sliding_window=None
    )
    assert torch.isfinite(got).all()
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(got.transpose(1, 2).double(), want, rtol=tol, atol=tol)


def test_a_mask_changed_in_place_or_replaced_is_read_again():
    """The lean path converts a mask once per forward (by identity and version) and remembers whether all of its rows
    let a key through: a mask edited in place, or another mask, is read again -- a row it empties gives zeros, not NaN
    and not the stale answer."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(shape, generator=g) for shape in ((2, 4, 1, 8), (2, 2, 12, 8), (2, 2, 12, 8)))
    kwargs = dict(scaling=0.3, softcap=2.0, causal=False, sliding_window=None)
    mask = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    assert torch.isfinite(lean.lean_attention(q, k, v, mask=mask, **kwargs)).all()
    mask[1] = False  # in place: the same tensor, a new version
    out = lean.lean_attention(q, k, v, mask=mask, **kwargs)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isfinite(out).all()
    other = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    other[0, ..., :5] = False
    want = _reference(q, k, v, scaling=0.3, softcap=2.0, mask=other, causal=False, window=None)
    got = lean.lean_attention(q, k, v, mask=other, **kwargs).transpose(1, 2).double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # float32 math against the float64 reference


def test_the_lean_path_is_taken_only_where_it_may(monkeypatch):
    """Decoding without gradient goes lean; a call that needs a gradient, many queries, or attention weights does
    not."""
    module = torch.nn.Module()
    module.is_causal = True
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 10, 8)
    with torch.no_grad():
        assert interface._lean(module, q, k, k, None, 0.3, 0.0, 2.0, None, None, {}) is not None
        assert interface._lean(module, q, k, k, None, 0.3, 0.0, 2.0, None, None, {"output_attentions": True}) is None
        long_q = torch.randn(1, 4, 40, 8)  # 80 rows per key head
        assert interface._lean(module, long_q, torch.randn(1, 2, 40, 8), k, None, 0.3, 0.0, 2.0, None, None, {}) is None
        # without a cap: one query against lean.MATH_MIN logits or more takes the lean path's math (faster than
        # sdpa's there); fewer logits, or several queries, take sdpa
        long_k = torch.randn(1, 2, lean.MATH_MIN // 4, 8)
        calls, real = [], lean.lean_attention
        monkeypatch.setattr(lean, "lean_attention", lambda *a, **kw: calls.append(kw["softcap"]) or real(*a, **kw))
        for query, key in ((q, long_k), (q, k), (torch.randn(1, 4, 3, 8), long_k)):
            out = interface._lean(module, query, key, key, None, 0.3, 0.0, None, None, None, {})
            # no mask: several queries are top-left causal (sdpa's is_causal), one query sees every key
            want = torch.nn.functional.scaled_dot_product_attention(
                query, key, key, is_causal=query.shape[2] > 1, scale=0.3, enable_gqa=True
            )
            torch.testing.assert_close(out, want.transpose(1, 2), rtol=1e-5, atol=1e-6)
        assert calls == [None]
    q.requires_grad_()
    assert interface._lean(module, q, k, k, None, 0.3, 0.0, 2.0, None, None, {}) is None


def test_eager_decoding_on_cuda_takes_the_lean_path_unless_the_kernels_are_asked_for(monkeypatch, kernels_on_cpu):
    """On CUDA an eager decoding call the kernels would take runs the lean path while the policy allows the PyTorch
    path (the host's launch cost decides there); ``use_fallback=False`` keeps it on the kernels, CPU tensors and
    compiled graphs are not affected. The decision, then its wiring: the kernels' route on the CPU (Triton's
    interpreter) with the decision forced, the call answered by the lean path, equal to the float64 reference."""
    from types import SimpleNamespace

    from hf_qknorm.attention import kernel_policy

    on_cuda = SimpleNamespace(device=torch.device("cuda", 0), is_cuda=True)
    on_cpu = SimpleNamespace(device=torch.device("cpu"), is_cuda=False)
    capturing = [False]  # a CUDA graph being captured? (asked only for CUDA tensors: a CPU build cannot answer)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    assert interface._lean_before_kernels(on_cuda) and not interface._lean_before_kernels(on_cpu)
    with kernel_policy(use_fallback=False):
        assert not interface._lean_before_kernels(on_cuda)
    capturing[0] = True
    assert not interface._lean_before_kernels(on_cuda)
    capturing[0] = False
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not interface._lean_before_kernels(on_cuda)

    module = torch.nn.Module()
    module.is_causal = True
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(shape, generator=g) for shape in ((2, 4, 1, 16), (2, 2, 40, 16), (2, 2, 40, 16)))
    rec = _Recorder(monkeypatch)
    with kernel_policy(devices=("cuda", "cpu")), torch.no_grad():
        assert interface._lean(module, q, k, v, None, 0.25, 0.0, 2.0, None, None, {}) is None  # CPU: the kernels'
        assert rec.calls == []
        monkeypatch.setattr(interface, "_lean_before_kernels", lambda query: True)
        out = interface._lean(module, q, k, v, None, 0.25, 0.0, 2.0, None, None, {})
    assert len(rec.calls) == 1
    want = _reference(q, k, v, scaling=0.25, softcap=2.0, mask=None, causal=False, window=None).transpose(1, 2)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)


def test_a_warm_modules_decoding_call_takes_the_one_query_route_only_where_it_may(monkeypatch):
    """Decoding's commonest calls (one query, no mask or a boolean one over the keys, CPU, eager) skip the general
    route once the module's arguments were validated (:func:`interface._one_query`). Everything that route decides
    must still hold on a warm module: a changed cap or scaling, a probe, a sink, attention weights, dropout in
    training, a gradient, a window the keys exceed without a mask, an additive mask or one of another shape, a policy
    that sends CPU tensors to the kernels -- each takes the general route, and every answer is the float64
    reference's."""
    from hf_qknorm.attention import kernel_policy

    taken, real = [], interface._one_query

    def spy(*args):
        out = real(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(interface, "_one_query", spy)
    module = torch.nn.Module()
    module.is_causal = True
    module.__dict__["_qknorm_softcap"] = 2.0  # a patched module's scheme cap
    g = torch.Generator().manual_seed(13)
    q, k, v = (
        torch.randn(s, generator=g, dtype=torch.float64) * 3 for s in ((2, 4, 1, 16), (2, 2, 40, 16), (2, 2, 40, 16))
    )

    def call(query=q, key=k, value=v, **kw):
        kw.setdefault("scaling", 0.25)
        return interface.qknorm_attention_forward(module, query, key, value, None, **kw)

    def want(cap=2.0, scaling=0.25, key=k, value=v, window=None, sink=None):
        ref = _reference(q, key, value, scaling=scaling, softcap=cap, mask=None, causal=False, window=window, sink=sink)
        return ref.transpose(1, 2)

    def check(got, expected, route):
        assert taken[-1] is route
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)

    def warm():  # the default arguments validated: the next call with them takes the one-query route
        call()
        check(call()[0], want(cap=module.__dict__["_qknorm_softcap"]), True)

    with torch.no_grad():
        check(call()[0], want(), False)  # the module's first call: the general route validates and remembers
        check(call()[0], want(), True)
        check(call(softcap=7.0)[0], want(), False)  # the model's own cap: the scheme's overrides it
        module.__dict__["_qknorm_softcap"] = 3.0  # the scheme's cap changed (e.g. a curriculum)
        check(call()[0], want(cap=3.0), False)
        check(call()[0], want(cap=3.0), True)
        check(call(scaling=0.5)[0], want(cap=3.0, scaling=0.5), False)
        warm()
        sink = torch.randn(4, generator=g, dtype=torch.float64)
        check(call(s_aux=sink)[0], want(cap=3.0, sink=sink), False)
        warm()
        out, weights = call(output_attentions=True)
        assert taken[-1] is False and weights is not None and weights.shape == (2, 4, 1, 40)
        torch.testing.assert_close(out, want(cap=3.0), rtol=1e-12, atol=1e-12)
        warm()
        module.config = types.SimpleNamespace(output_attentions=True)  # asked by the config, no output capture on
        out, weights = call()
        assert taken[-1] is False and weights is not None
        del module.config
        warm()
        for collecting, route in (({"attentions": []}, False), ({}, True)):  # an output capture running: it decides
            token = interface._active_collector.set(collecting)
            try:
                out, weights = call()
            finally:
                interface._active_collector.reset(token)
            assert taken[-1] is route and (weights is None) is route
            torch.testing.assert_close(out, want(cap=3.0), rtol=1e-12, atol=1e-12)
        probed = []
        module.__dict__["_qknorm_probes"] = {"tap": lambda *a, **kw: probed.append(kw["softcap"])}
        check(call()[0], want(cap=3.0), False)
        assert probed == [3.0]
        del module.__dict__["_qknorm_probes"]
        short = dict(key=k[:, :, :8], value=v[:, :, :8])
        check(call(sliding_window=8, **short)[0], want(3.0, **short), False)
        check(call(sliding_window=8, **short)[0], want(3.0, **short), True)
        check(call(sliding_window=8)[0], want(cap=3.0, window=8), False)  # 40 keys, a window of 8: masked
        warm()
        # a boolean mask over the keys (padding, a static cache's empty slots) is complete: the one-query route
        # takes it as the general route would, a window beside it included; other masks take the general route
        padded = torch.rand(2, 1, 1, 40, generator=g) > 0.3
        padded[..., -1] = True
        per_head = torch.rand(2, 4, 1, 40, generator=g) > 0.3
        per_head[..., 0] = True

        def masked(mask, **kw):
            kw.setdefault("scaling", 0.25)
            return interface.qknorm_attention_forward(module, q, k, v, mask, **kw)[0]

        def want_masked(mask):
            ref = _reference(q, k, v, scaling=0.25, softcap=3.0, mask=mask, causal=False, window=None)
            return ref.transpose(1, 2)

        check(masked(padded), want_masked(padded), True)
        check(masked(per_head), want_masked(per_head), True)
        check(masked(padded[:1]), want_masked(padded[:1]), True)  # one row for the batch
        check(masked(padded, sliding_window=8), want_masked(padded), False)  # a changed argument: validated first
        check(masked(padded, sliding_window=8), want_masked(padded), True)
        warm()
        additive = torch.zeros(2, 1, 1, 40, dtype=torch.float64).masked_fill(~padded, float("-inf"))
        taken.clear()
        got = masked(additive)
        assert not any(taken)  # the general route: the one-query route is not even asked
        torch.testing.assert_close(got, want_masked(padded), rtol=1e-12, atol=1e-12)
        with pytest.raises(ValueError, match="mask"):  # a mask of another shape: check_mask's error
            masked(padded[..., :39])
        assert taken[-1] is False
        warm()
        packed = dict(cu_seq_lens_q=torch.tensor([0, 1]), cu_seq_lens_k=torch.tensor([0, 40]))
        got = interface.qknorm_attention_forward(module, q[:1], k[:1], v[:1], None, scaling=0.25, **packed)[0]
        assert taken[-1] is False
        torch.testing.assert_close(got, want(cap=3.0)[:1], rtol=1e-12, atol=1e-12)
        warm()
        many = torch.randn(1, 2 * (lean.MAX_ROWS + 1), 1, 16, generator=g, dtype=torch.float64)  # too many rows
        got = interface.qknorm_attention_forward(module, many, k[:1], v[:1], None, scaling=0.25)[0]
        assert taken[-1] is False
        ref = _reference(many, k[:1], v[:1], scaling=0.25, softcap=3.0, mask=None, causal=False, window=None)
        torch.testing.assert_close(got, ref.transpose(1, 2), rtol=1e-12, atol=1e-12)
        warm()
        q32, k32, v32 = q.float(), k.float(), v.float()  # a dtype the kernels take (float64 would fall back)
        with kernel_policy(devices=("cuda", "cpu")):  # CPU tensors to the kernels: the one-query route steps aside
            assert real(module, q32, k32, v32, None, 0.25, 0.0, None, None, {}) is None
        assert real(module, q32, k32, v32, None, 0.25, 0.0, None, None, {}) is not None
        module.train()
        call(dropout=0.5)
        call(dropout=0.5)  # validated with this dropout: still not the one-query route in training
        assert taken[-1] is False
        module.eval()
        check(call()[0], want(cap=3.0), False)  # dropout 0 again: arguments changed since the last validated call
        check(call()[0], want(cap=3.0), True)
    grad_q = q.clone().requires_grad_()
    out, _ = interface.qknorm_attention_forward(module, grad_q, k, v, None, scaling=0.25)
    assert taken[-1] is False and out.requires_grad
    out.sum().backward()
    assert grad_q.grad is not None and torch.isfinite(grad_q.grad).all()
    module.__dict__["_qknorm_softcap"] = None  # no cap: sdpa for few logits, the lean math for many
    with torch.no_grad():
        call()
        check(call()[0], want(cap=None), True)
        long_k, long_v = (torch.randn(2, 2, lean.MATH_MIN // 4, 16, generator=g, dtype=torch.float64) for _ in "kv")
        check(call(key=long_k, value=long_v)[0], want(cap=None, key=long_k, value=long_v), True)


# ---- the calls real generation makes, every cache kind ----


class _Recorder:
    """Spies on the lean path: records each call it answered, with its inputs and output."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = lean.lean_attention

        def spy(query, key, value, **kw):
            out = real(query, key, value, **kw)
            self.calls.append((query.clone(), key.clone(), value.clone(), dict(kw), out.clone()))
            return out

        monkeypatch.setattr(lean, "lean_attention", spy)


def _model(family, scheme, **overrides):
    model = tiny_model(family, dtype=torch.float64, **overrides)
    if scheme is not None:
        hf_qknorm.patch_model(model, scheme, softcap=2.0 if "cap" in scheme else None)
        with torch.no_grad():
            for name, prm in model.named_parameters():
                if "q_proj" in name or "k_proj" in name:
                    prm.mul_(3)  # logits large enough for the cap to bend them
    model.set_attn_implementation("qknorm")
    return model


@pytest.mark.parametrize(
    "family,scheme,cache,padded",
    [
        ("llama", "qk_norm_cap", None, False),
        ("llama", "qk_norm_cap", None, True),
        ("llama", "soft_cap", "static", True),
        ("qwen3", "qk_norm_cap", "static", False),
        ("mistral", "qk_norm_cap", "sliding_window", True),
        ("mistral", "soft_cap", None, False),
        ("gpt2", "qk_norm_cap", "static", True),
    ],
)
def test_generation_calls_through_the_lean_path_match_float64(monkeypatch, family, scheme, cache, padded):
    model = _model(family, scheme)
    rec = _Recorder(monkeypatch)
    ids = torch.randint(1, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :6] = 0
    kwargs = {} if cache is None else {"cache_implementation": cache}
    model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0, **kwargs)
    decode = [c for c in rec.calls if c[0].shape[2] == 1]
    assert len(decode) >= 19 * model.config.num_hidden_layers  # every decoding step of every layer went lean
    for query, key, value, kw, out in decode:
        want = _reference(
            query,
            key,
            value,
            scaling=kw["scaling"],
            softcap=kw["softcap"],
            mask=kw["mask"],
            causal=kw["causal"],
            window=kw["sliding_window"],
        )
        assert kw["softcap"] == 2.0
        torch.testing.assert_close(out.transpose(1, 2), want, rtol=1e-12, atol=1e-12)
    if cache in ("static", "sliding_window") or padded:
        assert any(kw["mask"] is not None for *_, kw, _ in decode)  # the masked kinds were exercised


def test_lean_constants_are_kept_per_dtype_and_bounded():
    """The scale and cap are applied as 0-d tensors made once per (value, dtype): a float64 call after a
    float32 call with the same values computes with float64 constants (float64-exact), and a caller sweeping values
    does not grow the store without bound."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(shape, generator=g, dtype=torch.float64) for shape in ((2, 4, 1, 8), (2, 2, 30, 8), (2, 2, 30, 8))
    )
    kwargs = dict(scaling=0.1 + 1e-9, softcap=3.0 + 1e-9, mask=None, causal=False, sliding_window=None)
    want = _reference(
        q, k, v, scaling=kwargs["scaling"], softcap=kwargs["softcap"], mask=None, causal=False, window=None
    )
    lean.lean_attention(q.float(), k.float(), v.float(), **kwargs)  # float32 constants of the same values first
    got = lean.lean_attention(q, k, v, **kwargs)
    torch.testing.assert_close(got.transpose(1, 2), want, rtol=1e-12, atol=1e-12)
    for i in range(2 * lean._CONSTANTS_MAX):
        lean.lean_attention(q, k, v, scaling=0.1, softcap=1.0 + i, mask=None, causal=False, sliding_window=None)
    assert len(lean._CONSTANTS) <= lean._CONSTANTS_MAX

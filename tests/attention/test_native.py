"""The native ops (hf_qknorm/attention/_native.c, :mod:`hf_qknorm.attention.native`): the decoding op (one capped
float32 query per row in one call, through lean._native_capped) and the tiled path's capped elementwise passes.

Checked against :func:`hf_qknorm.reference.attention_reference` in float64 -- for decoding every layout the caches
hand it, masks, rows with no key, GQA, head dims, caps from 1 to 500, non-finite inputs, its tanh and exp on a dense
grid, and a generation with it against the same model without it; for the tiled passes outputs and gradients with
masks, windows, GQA, kept and recomputed tanh, the per-head max logits -- and which calls take them and which do not."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import hf_qknorm
from hf_qknorm.attention import chunked, lean, tiles
from hf_qknorm.attention import native as native_op
from hf_qknorm.reference import attention_reference
from tests._support.tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.skipif(native_op.MODULE is None, reason="the native op was not built here")


@pytest.fixture
def native():
    """The native op in use for the test, whatever the environment says."""
    saved = lean.NATIVE[0]
    lean.NATIVE[0] = native_op.MODULE
    yield native_op.MODULE
    lean.NATIVE[0] = saved


class _Spy:
    """Stands in for the native module and counts its calls (and keeps their names)."""

    def __init__(self, module):
        self.module, self.calls, self.names = module, 0, []

    def __getattr__(self, name):
        function = getattr(self.module, name)

        def counted(*args):
            self.calls += 1
            self.names.append(name)
            return function(*args)

        return counted


def _call(q, k, v, *, scaling=0.3, softcap=5.0, mask=None, window=None):
    return lean.lean_attention(
        q, k, v, scaling=scaling, softcap=softcap, mask=mask, causal=False, sliding_window=window
    )


def _reference(q, k, v, *, scaling=0.3, softcap=5.0, mask=None, window=None):
    q, k, v = q.double(), k.double(), v.double()
    return attention_reference(
        q, k, v, scaling=scaling, softcap=softcap, causal=False, mask=mask, sliding_window=window
    )


def _inputs(batch, heads, kv_heads, kv_len, dim, seed=0, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 1, heads, dim, generator=g).transpose(1, 2) * spread  # the layout the projections give
    k = torch.randn(batch, kv_heads, kv_len, dim, generator=g)
    v = torch.randn(batch, kv_heads, kv_len, dim, generator=g)
    return q, k, v


def _assert_reference(got, q, k, v, **kw):
    """``got`` within float32's error of the float64 reference: about as far from it as the ATen ops' result, which
    rounds the same sums in its own order (over 540 random calls of three shapes and three caps: median 0.87 times
    their error, at most 3.3 times where both were below 1e-6), and close in absolute terms."""
    expected = _reference(q, k, v, **kw).transpose(1, 2)  # (batch, 1, heads, dim)
    assert got.shape == expected.shape and got.dtype == torch.float32
    saved, lean.NATIVE[0] = lean.NATIVE[0], None
    try:
        aten = _call(q, k, v, **kw)
    finally:
        lean.NATIVE[0] = saved
    error, aten_error = ((x.double() - expected).abs().max().item() for x in (got, aten))
    assert error <= max(3 * aten_error, 2e-6), (error, aten_error)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "shape",
    [
        (1, 4, 2, 37, 16),  # GQA, the tiny test models' shape
        (3, 4, 4, 1, 8),  # one key: the output is its value
        (2, 6, 2, 513, 64),  # past the vector width in keys, odd length
        (1, 12, 12, 200, 128),
        (2, 8, 1, 64, 512),  # the largest head dim it takes
        (2, 4, 2, 517, 16),  # a small head dim (its values' sums over the keys), three blocks of keys, odd tails
        (1, 2, 1, 259, 32),  # the largest head dim summed over the keys
        (1, 4, 4, 300, 40),  # the smallest summed per key
        (1, 2, 2, 7, 24),  # fewer keys than eight: each key's logit alone
    ],
)
@pytest.mark.parametrize("softcap", [1.0, 5.0, 50.0, 500.0])
def test_matches_the_float64_reference(native, shape, softcap):
    spy = _Spy(native)
    lean.NATIVE[0] = spy
    q, k, v = _inputs(*shape, seed=int(softcap))
    got = _call(q, k, v, softcap=softcap)
    assert spy.calls == 1
    _assert_reference(got, q, k, v, softcap=softcap)


@pytest.mark.parametrize("kind", ["batch", "heads", "empty_row", "window"])
def test_masks_and_windows(native, kind):
    batch, heads, kv_heads, kv_len = 3, 4, 2, 41
    q, k, v = _inputs(batch, heads, kv_heads, kv_len, 16, seed=3)
    g = torch.Generator().manual_seed(4)
    mask, window = None, None
    if kind == "batch":  # padding, a static cache's empty slots: (batch, 1, 1, kv_len)
        mask = torch.rand(batch, 1, 1, kv_len, generator=g) > 0.4
        mask[..., -1] = True
    elif kind == "heads":
        mask = torch.rand(batch, heads, 1, kv_len, generator=g) > 0.4
        mask[..., 0] = True
    elif kind == "empty_row":  # a row with no allowed key gives zeros
        mask = torch.ones(batch, 1, 1, kv_len, dtype=torch.bool)
        mask[1] = False
    else:  # one query with a window and no mask sees the last `window` keys
        window = 9
    spy = _Spy(native)
    lean.NATIVE[0] = spy
    got = _call(q, k, v, mask=mask, window=window)
    assert spy.calls == 1
    _assert_reference(got, q, k, v, mask=mask, window=window)
    if kind == "empty_row":
        assert torch.equal(got[1], torch.zeros_like(got[1]))


def test_strided_caches(native):
    """A static cache's keys trimmed to the filled slots, and a key cache that is a slice of a larger buffer: rows
    contiguous, the rest strided."""
    big_k = torch.randn(2, 3, 50, 16)
    big_v = torch.randn(2, 3, 50, 16)
    k, v = big_k[:, :, :23], big_v[:, :, 5:28]
    q = torch.randn(2, 6, 1, 16)  # contiguous (batch, heads, 1, dim)
    assert not k.is_contiguous()
    _assert_reference(_call(q, k, v), q, k, v)


def test_a_broadcast_mask_over_batch_and_heads(native):
    q, k, v = _inputs(4, 4, 2, 30, 16, seed=5)
    mask = (torch.arange(30) % 3 != 0).view(1, 1, 1, 30)
    _assert_reference(_call(q, k, v, mask=mask), q, k, v, mask=mask)


def test_tanh_and_exp_on_a_grid(native):
    """Two keys, the second's logit 0 and value 0: the output is sigmoid(c * tanh(s / c)) times the first value --
    the op's tanh over its whole range (the polynomial below 0.625, the exp form, the clamp at 9.5, infinities)."""
    s = torch.cat([torch.linspace(-12, 12, 4001), torch.tensor([0.0, 1e-30, -1e-30, 0.6249, 0.6251, 9.49, 9.51, 40.0])])
    s = torch.cat([s, torch.tensor([float("inf"), float("-inf")])])
    n = s.numel()
    q = torch.zeros(n, 1, 1, 8)
    q[:, 0, 0, 0] = 1.0
    k = torch.zeros(n, 1, 2, 8)
    k[:, 0, 0, 0] = s  # logit = s (scaling 1), the second key's logit 0
    v = torch.zeros(n, 1, 2, 8)
    v[:, 0, 0, :] = 1.0
    for cap in (1.0, 3.0):
        got = _call(q, k, v, scaling=1.0, softcap=cap)[:, 0, 0, 0].double()
        expected = torch.sigmoid(cap * torch.tanh(s.double() / cap))
        torch.testing.assert_close(got, expected, atol=3e-7, rtol=1e-6)


def _ulps(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """``|got - expected|`` in units of float32's spacing at ``expected`` (the float64 value)."""
    spacing = torch.nextafter(expected.abs().float(), torch.tensor(float("inf"))).double() - expected.abs().float()
    return (got.double() - expected).abs() / spacing.double()


def _dense_grid() -> torch.Tensor:
    """Float32 arguments over the elementwise functions' whole range, both signs: tiny ones, every region boundary
    and around 1, the clamp, infinities."""
    g = torch.Generator().manual_seed(13)
    tiny = torch.logspace(-40, -2, 20001, dtype=torch.float64)
    dense = torch.linspace(0, 12, 400001, dtype=torch.float64)
    scattered = torch.rand(200000, generator=g, dtype=torch.float64) * 20
    edges = torch.tensor([0.5, 0.55, 0.625, 0.6875, 1, 2, 7.9, 8, 9, 9.5, 10, 40, 1e30], dtype=torch.float64)
    x = torch.cat([tiny, dense, scattered, edges]).float()
    return torch.cat([x, -x, torch.tensor([float("inf"), float("-inf")])])


def test_tiled_forward_tanh_and_exp2_within_two_ulp(native):
    """The forward pass's kept tanh and its exponents over a dense grid, against float64: tanh within 2 ulp of the
    true value everywhere (its error, times the cap, is a logit's error: a relative bound keeps small logits as exact
    as the ATen ops make them), never past +-1, odd, exact at 0, +-1 at the infinities; 2^(gain * t) within 2 ulp."""
    s = _dense_grid()
    for gain in (1.0, 72.1, -126.0):
        x = (2 * s).contiguous()  # the pass reads 2s/c and takes tanh of half of it (exact)
        kept, sums = torch.empty_like(x), torch.empty(1, 1, 1)
        native_op.forward_tile(native, x.view(1, 1, -1), kept.view(1, 1, -1), sums, gain)
        finite = torch.isfinite(s)
        expected = torch.tanh(s.double())
        assert _ulps(kept[finite], expected[finite]).max().item() <= 2.0
        assert kept.abs().max().item() <= 1.0
        assert torch.equal(kept[~finite], torch.sign(s[~finite]))
        half = (s.numel() - 2) // 2  # the grid, then its negation, then the two infinities
        assert torch.equal(kept[:half], -kept[half:-2])  # odd, to the bit
        exponent = (torch.tensor(gain, dtype=torch.float32) * kept).double()  # the pass's float32 exponent
        assert _ulps(x, torch.exp2(exponent)).max().item() <= 2.0
    zeros, kept, sums = torch.tensor([[[0.0, -0.0]]]), torch.empty(1, 1, 2), torch.empty(1, 1, 1)
    native_op.forward_tile(native, zeros, kept, sums, 1.0)
    assert torch.equal(kept.flatten(), torch.zeros(2))  # tanh(+-0) = 0 (the sign of a zero logit changes nothing)


def test_tiled_forward_refuses_a_gain_that_needs_the_row_shift(native):
    x, sums = torch.zeros(1, 1, 8), torch.empty(1, 1, 1)
    for gain in (127.0, -127.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"within \[-126, 126\] \(no row shift\), got -?(127|nan|inf)$"):
            native_op.forward_tile(native, x, None, sums, gain)
    assert torch.equal(x, torch.zeros(1, 1, 8))  # nothing written


def _band_reference(rows, cols, band):
    """Boolean ``(rows, cols)``: which columns each row of a block may see, written from the band's definition."""
    lo0, lo_step, hi0, hi_step, groups = band
    allowed = torch.zeros(rows, cols, dtype=torch.bool)
    for i in range(rows):
        qi = i // groups
        for j in range(cols):
            allowed[i, j] = lo0 + lo_step * qi <= j < hi0 + hi_step * qi
    return allowed


@pytest.mark.parametrize(
    "band",
    [
        (0, 0, 300, 1, 2),  # causal, the diagonal near the end: nothing outside
        (0, 0, 3, 1, 2),  # causal on the diagonal: whole chunks past it
        (0, 0, -5, 1, 4),  # bottom-right aligned with more queries than keys: the first rows see nothing
        (-2, 1, 5, 1, 1),  # a window of 7
        (290, 1, 600, 0, 3),  # a window's trailing edge without causality, a whole chunk before it
        (0, 0, 600, 0, 1),  # everything
    ],
)
def test_tiled_passes_band(native, band):
    """The passes' causal/window band against the same call without one: outside the band p (and the kept tanh,
    the slope) exactly 0, inside the same bits as without a band, each row's sum the sum of its allowed p."""
    blocks, rows, cols, gain = 2, 12, 530, 7.2  # 530 columns: two whole chunks of 256 and a tail, not a multiple of 8
    g = torch.Generator().manual_seed(sum(band))
    x = torch.randn(blocks, rows, cols, generator=g) * 3
    allowed = _band_reference(rows, cols, band).expand(blocks, rows, cols)
    free_p, free_kept, free_sums = x.clone(), torch.empty_like(x), torch.empty(blocks, rows, 1)
    native_op.forward_tile(native, free_p, free_kept, free_sums, gain)
    p, kept, sums = x.clone(), torch.full_like(x, float("nan")), torch.empty(blocks, rows, 1)
    native_op.forward_tile(native, p, kept, sums, gain, band)
    assert torch.equal(p[allowed], free_p[allowed]) and torch.equal(kept[allowed], free_kept[allowed])
    assert not p[~allowed].any()
    assert not torch.isnan(kept).any()  # every kept value written: backward may read any of them
    expected = (free_p * allowed).double().sum(-1, keepdim=True)
    torch.testing.assert_close(sums.double(), expected, rtol=2e-6, atol=0)
    neg_lse = -torch.rand(blocks, rows, 1, generator=g) * 4
    for recompute, src in ((True, x), (False, free_kept)):
        out = {}
        for name, extra in (("free", ()), ("band", band)):
            bp, slope = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
            native_op.backward_p(native, src, recompute, neg_lse, bp, slope, gain, extra)
            out[name] = bp, slope
        for got, free in zip(out["band"], out["free"]):
            assert torch.equal(got[allowed], free[allowed]) and not got[~allowed].any()
            assert not torch.isnan(got).any()


def test_tiled_passes_band_arguments(native):
    x, sums = torch.zeros(1, 1, 8), torch.empty(1, 1, 1)
    with pytest.raises(ValueError, match=r"^band groups must be positive, got 0$"):
        native_op.forward_tile(native, x, None, sums, 1.0, (0, 0, 8, 0, 0))
    with pytest.raises(TypeError, match=r"^forward_f32 takes 4 or 9 arguments, got 6$"):
        native_op.forward_tile(native, x, None, sums, 1.0, (0, 0))
    with pytest.raises(TypeError, match=r"^backward_p_f32 takes 6 or 11 arguments, got 7$"):
        native_op.backward_p(native, x, False, sums, x, x, 1.0, (3,))
    assert torch.equal(x, torch.zeros(1, 1, 8))  # nothing written


def _shrunk(t: torch.Tensor, elements: int) -> torch.Tensor:
    """``t`` whose storage holds only ``elements`` elements: its shape and strides reach past the end (a view that
    outlives a storage resized under it), which torch's own checks do not catch at a data pointer."""
    t = t.clone()
    t.untyped_storage().resize_(elements * t.element_size())
    return t


_PROBLEMS = {
    "dtype": "has the wrong dtype",
    "rank": "has the wrong number of dimensions",
    "shape": "has a shape that does not match the other arguments",
    "stride": "has strides the op does not take",
    "bounds": "reaches past the end of its storage",
    "sizes": "has sizes the op does not take",
}


def _hostile_decode(case: str):
    """(arguments to native.capped_cpu, the argument the C code must name, the problem) for one hostile call."""
    q, k, v = _inputs(2, 4, 2, 9, 16)
    mask = None
    name, problem = {
        "query_dtype": ("query", "dtype"),
        "query_rank": ("query", "rank"),
        "two_queries": ("query", "shape"),
        "key_batch": ("key", "shape"),
        "value_keys": ("value", "shape"),
        "mask_length": ("mask", "shape"),
        "mask_dtype": ("mask", "dtype"),
        "key_stride": ("key", "stride"),
        "key_storage": ("key", "bounds"),
        "value_offset": ("value", "bounds"),
        "mask_storage": ("mask", "bounds"),
        "head_dim": (None, "sizes"),
        "heads": (None, "sizes"),
    }[case]
    if case == "query_dtype":
        q = q.double()
    elif case == "query_rank":
        q = q[0]
    elif case == "two_queries":
        q = torch.randn(2, 4, 2, 16)
    elif case == "key_batch":
        k = k[:1]
    elif case == "value_keys":
        v = v[:, :, :5]
    elif case == "mask_length":
        mask = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    elif case == "mask_dtype":
        mask = torch.ones(2, 1, 1, 9)
    elif case == "key_stride":  # every other float of a row: in bounds, but not the contiguous rows the loads take
        k = torch.randn(2, 2, 9, 32).as_strided(k.shape, (576, 288, 32, 2))
    elif case == "key_storage":
        k = _shrunk(k, k.numel() - 1)  # one float short
    elif case == "value_offset":  # a view into the cache whose storage ends before its last key
        v = torch.randn(2, 2, 10, 16)[:, :, 1:]
        v.untyped_storage().resize_(v.untyped_storage().nbytes() - 4)
    elif case == "mask_storage":
        mask = _shrunk(torch.ones(2, 4, 1, 9, dtype=torch.bool), 20)
    elif case == "head_dim":
        q, k, v = (x[..., :12] for x in (q, k, v))
    elif case == "heads":
        q = torch.randn(2, 3, 1, 16)
    return (q, k, v, mask, 0.25, 5.0), name, _PROBLEMS[problem]


_HOSTILE = ["query_dtype", "query_rank", "two_queries", "key_batch", "value_keys", "mask_length", "mask_dtype",
            "key_stride", "key_storage", "value_offset", "mask_storage", "head_dim", "heads"]  # fmt: skip


@pytest.mark.parametrize("case", _HOSTILE)
def test_the_c_code_refuses_a_hostile_call_in_one_line(native, case):
    """Every check in the C code, reached by a call lean.py never makes: one ValueError naming the argument and
    the problem, one line, nothing read or written -- through the function and through the custom op."""
    args, name, problem = _hostile_decode(case)
    start = f"hf_qknorm native capped_f32: {name} {problem}" if name else f"hf_qknorm native capped_f32: {problem}"
    for call in (native_op.capped_cpu, torch.ops.hf_qknorm.capped_decode):
        with pytest.raises(ValueError) as caught:
            call(*args)
        message = str(caught.value)
        assert message.startswith(start) and "\n" not in message, message


def test_a_cap_that_is_not_positive_is_refused(native):
    q, k, v = _inputs(1, 4, 2, 8, 16)
    for cap in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"^hf_qknorm native capped_f32: cap must be positive, got (0|-1|nan)$"):
            native_op.capped_cpu(q, k, v, None, 0.25, cap)


def test_the_output_is_checked_too(native):
    """The C code writes only ``out``: an out too small for the call, or of another dtype, is refused."""
    q, k, v = _inputs(2, 4, 2, 9, 16)
    for out, problem in ((torch.empty(2, 1, 4, 8), "shape"), (torch.empty(2, 1, 4, 16).double(), "dtype"),
                         (_shrunk(torch.empty(2, 1, 4, 16), 100), "bounds")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"^hf_qknorm native capped_f32: out {_PROBLEMS[problem]}"):
            native.capped_f32(q, k, v, None, out, 0.25, 5.0)


class _Sub(torch.Tensor):
    """A tensor subclass: its data pointer is not the C code's to trust."""


def test_only_a_plain_tensor_is_taken(native):
    """The C code reads each tensor's metadata itself and takes only a plain ``torch.Tensor``: anything else -- a
    subclass, a tuple that says where some memory is -- is a ``TypeError`` naming the argument, nothing read or
    written, through every entry point."""
    q, k, v = _inputs(1, 4, 2, 8, 16)
    out = torch.zeros(1, 1, 4, 16)
    fake = (k.data_ptr(), 1, tuple(k.shape), k.stride(), 0, k.untyped_storage().nbytes())
    for bad, name in ((k.as_subclass(_Sub), "key"), (fake, "key"), (None, "key")):
        with pytest.raises(TypeError, match=rf"^hf_qknorm native: {name} must be a torch.Tensor \(not a subclass\)"):
            native.capped_f32(q, bad, v, None, out, 0.25, 5.0)
    with pytest.raises(TypeError, match=r"^hf_qknorm native: query must be a torch.Tensor"):
        native_op.capped_cpu(q.as_subclass(_Sub), k, v, None, 0.25, 5.0)
    x, sums = torch.zeros(1, 1, 8), torch.zeros(1, 1, 1)
    with pytest.raises(TypeError, match=r"^hf_qknorm native: sums must be a torch.Tensor"):
        native_op.forward_tile(native, x, None, sums.as_subclass(_Sub), 1.0)
    with pytest.raises(TypeError, match=r"^hf_qknorm native: delta must be a torch.Tensor"):
        native_op.backward_ds(native, x, x.clone(), x.clone(), (1, 2))
    assert not out.any() and not x.any()


@pytest.mark.parametrize("case", ["x_storage", "kept_dtype", "sums_rows", "x_stride", "lse_storage", "delta_rank"])
def test_the_tiled_passes_refuse_a_hostile_call(native, case):
    x, kept, sums = torch.zeros(2, 3, 8), torch.zeros(2, 3, 8), torch.zeros(2, 3, 1)
    lse, name, problem = (
        torch.zeros(2, 3, 1),
        *{
            "x_storage": ("x", "bounds"),
            "kept_dtype": ("kept", "dtype"),
            "sums_rows": ("sums", "shape"),
            "x_stride": ("x", "stride"),
            "lse_storage": ("neg_lse", "bounds"),
            "delta_rank": ("delta", "rank"),
        }[case],
    )
    if case == "x_storage":
        x = _shrunk(x, 40)
    elif case == "kept_dtype":
        kept = kept.double()
    elif case == "sums_rows":
        sums = torch.zeros(2, 2, 1)
    elif case == "x_stride":
        x = torch.zeros(2, 8, 3).transpose(1, 2)
    elif case == "lse_storage":
        lse = _shrunk(lse, 5)
    with pytest.raises(ValueError, match=rf"^hf_qknorm native \w+: {name} {_PROBLEMS[problem]}"):
        if case.startswith("lse"):
            native_op.backward_p(native, x, True, lse, kept, sums.expand(2, 3, 8).contiguous(), 1.0)
        elif case.startswith("delta"):
            native_op.backward_ds(native, x, kept, kept.clone(), lse[0])
        else:
            native_op.forward_tile(native, x, kept, sums, 1.0)


def test_non_finite_inputs(native):
    q, k, v = _inputs(3, 2, 1, 10, 8, seed=6)
    q = q.abs().contiguous() + 0.1  # positive queries: a key of +inf gives a logit of +inf, not NaN
    k = k.clone()
    k[0, 0, 3, 0] = float("nan")  # batch 0 sees a NaN logit: NaN rows, as softmax gives
    k[1, 0, 4] = float("inf")  # a logit of +inf is capped to c (tanh(inf) = 1)
    k[2, 0, 5] = 1e30  # a finite logit far past the tanh's clamp
    got = _call(q, k, v)
    assert torch.isnan(got[0]).all()
    assert torch.isfinite(got[1:]).all()
    _assert_reference(got[1:], q[1:], k[1:], v[1:])


class _Subclass(torch.Tensor):
    pass


@pytest.mark.parametrize(
    "why",
    ["float64", "bfloat16", "head_dim", "uncapped", "two_queries", "grad", "sink", "subclass", "disabled"],
)
def test_calls_it_does_not_take(native, why):
    """Every other call takes the ATen ops -- the same values to the reference -- and never the op."""
    spy = _Spy(native)
    lean.NATIVE[0] = None if why == "disabled" else spy
    dim = 12 if why == "head_dim" else 16
    q, k, v = _inputs(2, 4, 2, 17, dim, seed=7)
    kw = dict(scaling=0.3, softcap=None if why == "uncapped" else 5.0, mask=None, causal=False, sliding_window=None)
    if why in ("float64", "bfloat16"):
        dtype = torch.float64 if why == "float64" else torch.bfloat16
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if why == "two_queries":
        q = torch.randn(2, 4, 2, dim)
    if why == "grad":
        q.requires_grad_(True)
    if why == "sink":
        kw["sink"] = torch.randn(4)
    if why == "subclass":  # a tensor subclass (a DTensor, a fake tensor) may not hold its values at its pointer
        q, k, v = (x.as_subclass(_Subclass) for x in (q, k, v))
    with torch.enable_grad():
        got = lean.lean_attention(q, k, v, **kw)
    assert spy.calls == 0
    if why == "sink":  # the sink's own values: tests/attention/test_lean_decode.py
        return
    expected = attention_reference(
        q.double(), k.double(), v.double(), scaling=0.3, softcap=kw["softcap"], causal=False, sliding_window=None
    ).transpose(1, 2)
    tol = 2e-2 if why == "bfloat16" else 1e-5
    torch.testing.assert_close(got.detach().double(), expected, atol=tol, rtol=tol)


def test_several_threads_keep_large_calls_on_the_aten_ops(native):
    spy = _Spy(native)
    lean.NATIVE[0] = spy
    threads = torch.get_num_threads()
    small = _inputs(1, 4, 2, 64, 16)
    large = _inputs(2, 8, 2, native_op.PARALLEL_MAX // 16 + 1, 16)  # just past the limit
    try:
        torch.set_num_threads(2)
        _call(*large)
        assert spy.calls == 0
        _call(*small)
        assert spy.calls == 1
        torch.set_num_threads(1)
        _call(*large)
        assert spy.calls == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.spawns
def test_the_environment_switch_turns_it_off(monkeypatch):
    """The switch is read when the module is imported (a fresh interpreter), by :func:`native._initial` (the
    values, in this process)."""
    code = "from hf_qknorm.attention import native; print(native.NATIVE[0] is None, native.MODULE is None)"
    env = dict(os.environ, HF_QKNORM_NATIVE="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False"]
    assert native_op.MODULE is not None
    for value, on in (("1", True), (" Off ", False), ("", True), ("no", False)):
        monkeypatch.setenv("HF_QKNORM_NATIVE", value)
        assert native_op._initial() is (native_op.MODULE if on else None), value


_REFUSED = (
    "import torch\n"
    "from hf_qknorm.attention import lean\n"
    "q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)\n"
    "call = dict(scaling=0.3, mask=None, causal=False, sliding_window=None)\n"
    "print(lean.lean_attention(q, k, v, softcap=None, **call).shape)  # not the op's call: the switch is moot\n"
    "lean.lean_attention(q, k, v, softcap=5.0, **call)\n"
)


@pytest.mark.spawns
def test_an_unknown_switch_value_refuses_the_ops_first_call():
    """A value that is neither on nor off: importing works (the command line can still say what is wrong), and the
    first call the op would take raises one line naming the value and the valid ones -- never the ATen ops measured
    under the op's name."""
    env = dict(os.environ, HF_QKNORM_NATIVE="nope")
    run = subprocess.run([sys.executable, "-c", _REFUSED], env=env, capture_output=True, text=True)
    assert run.returncode == 1 and run.stdout.strip() == "torch.Size([1, 1, 2, 16])", run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "hf_qknorm.kernels._env.SwitchError: HF_QKNORM_NATIVE='nope' is not one of 0, off, false, no, 1, on, true, "
        "yes (or unset: the native op where it was built)"
    )


@pytest.mark.parametrize(
    ("value", "on"),
    [(None, True), ("", True), (" ", True), ("1", True), ("YES", True), (" true ", True)]
    + [("0", False), ("off", False), ("No", False)],
)
def test_the_switch_spellings(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("HF_QKNORM_NATIVE", raising=False)
    else:
        monkeypatch.setenv("HF_QKNORM_NATIVE", value)
    assert native_op.requested() is on


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("scheme", ["soft_cap", "qk_norm_cap"])
def test_generation_with_and_without_it(native, cache, scheme):
    """Greedy generation of a patched model, float32, with left padding: the op runs (counted), and the logits agree
    with the same model run without it, and with its float64 copy."""
    model = tiny_model("llama", seed=11)
    hf_qknorm.patch_model(model, scheme, softcap=4.0)
    model.eval()
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :3] = 0  # left padding: the decoding calls carry a mask
    options = dict(
        max_new_tokens=6,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        cache_implementation=cache,
        attention_mask=attention_mask,
    )
    spy = _Spy(native)
    lean.NATIVE[0] = spy
    with torch.no_grad():
        fast = model.generate(ids, **options)
    assert spy.calls > 0
    lean.NATIVE[0] = None
    with torch.no_grad():
        slow = model.generate(ids, **options)
    assert torch.equal(fast.sequences, slow.sequences)
    for a, b in zip(fast.logits, slow.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    lean.NATIVE[0] = native
    # a fresh float64 copy: Transformers 5.4's generate reuses the static cache a float32 run left, whatever the dtype
    reference = tiny_model("llama", seed=11).double()
    hf_qknorm.patch_model(reference, scheme, softcap=4.0)
    reference.eval()
    with torch.no_grad():
        exact = reference.generate(ids, **options)
    for a, b in zip(fast.logits, exact.logits):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-4, rtol=1e-4)


# ---- the tiled path's capped passes ----


def _tiled(q, k, v, *, grad_out, **kw):
    args = tuple(x.clone().requires_grad_() for x in (q, k, v))
    out = chunked.chunked_attention(*args, **kw)
    out, top = out if kw.get("return_max_logits") else (out, None)
    return (out, *torch.autograd.grad(out, args, grad_out)), top


@pytest.mark.parametrize("tq,tk", [(1, 1), (37, 37), (130, 130), (5, 60), (60, 5)])
@pytest.mark.parametrize("pattern", ["causal", "window", "mask", "full", "causal_mask", "window_only"])
@pytest.mark.parametrize("keep", ["all", "part", "none"])
@pytest.mark.parametrize("softcap", [2.0, 50.0])
def test_tiled_passes_match_the_float64_reference(native, monkeypatch, tq, tk, pattern, keep, softcap):
    """Output and gradients of a capped float32 call through the native passes: within the flash rule of the ATen
    passes' own error against float64 (3x, plus 1e-6), the per-head max logits the same; tiles kept, partly kept or
    recomputed in backward, edge tiles masked."""
    monkeypatch.setattr(tiles, "TILE_ELEMENTS", 2 * 16 * tk)  # several tiles
    monkeypatch.setattr(tiles, "QUERY_ROWS", 8)
    monkeypatch.setattr(chunked, "KEEP_TANH_MAX", {"all": 1 << 22, "part": 2 * 4 * tq * tk // 2, "none": 0}[keep])
    g = torch.Generator().manual_seed(tq * 1000 + tk)
    q = torch.randn(2, 4, tq, 16, generator=g) * 3
    k, v = torch.randn(2, 2, tk, 16, generator=g) * 3, torch.randn(2, 2, tk, 16, generator=g)
    grad_out = torch.randn(2, 4, tq, 16, generator=g)
    kw = dict(scaling=0.25, softcap=softcap, causal=pattern in ("causal", "window", "causal_mask"))
    kw["return_max_logits"] = True
    if pattern in ("window", "window_only"):
        kw["sliding_window"] = 7
    if pattern in ("mask", "causal_mask"):
        kw["mask"] = torch.rand(2, 1, tq, tk, generator=g) > 0.3
    spy = _Spy(native)
    lean.NATIVE[0] = spy
    got, top = _tiled(q, k, v, grad_out=grad_out, **kw)
    assert spy.calls > 0
    lean.NATIVE[0] = None
    aten, aten_top = _tiled(q, k, v, grad_out=grad_out, **kw)
    torch.testing.assert_close(top, aten_top, rtol=0, atol=0)  # the max is taken before any native pass
    ref_kw = {key: value for key, value in kw.items() if key != "return_max_logits"}
    ref, *ref_grads = _tiled(q.double(), k.double(), v.double(), grad_out=grad_out.double(), **ref_kw)[0]
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), got, aten, (ref, *ref_grads)):
        error, aten_error = ((x.double() - r).abs().max().item() for x in (a, b))
        assert error <= 3 * aten_error + 1e-6, (name, error, aten_error)


@pytest.mark.parametrize(
    "why", ["two_threads", "dropout", "large_cap", "sink", "float64", "uncapped", "subclass", "disabled"]
)
def test_tiled_passes_stay_off_where_they_do_not_apply(native, why):
    """Every other call keeps the ATen passes: several threads on tiles past :data:`.native.PARALLEL_MAX` (the ATen
    passes share a tile among them), dropout, a cap whose exponents need the row shift, a sink (which forces it),
    float64, no cap, the op turned off."""
    spy = _Spy(native)
    lean.NATIVE[0] = None if why == "disabled" else spy
    g = torch.Generator().manual_seed(9)
    dtype = torch.float64 if why == "float64" else torch.float32
    length = 200 if why == "two_threads" else 20  # two threads: tiles of 4 * 32 * 200 logits, past the limit
    q, k, v = (torch.randn(1, 4, length, 16, generator=g, dtype=dtype, requires_grad=True) for _ in range(3))
    kw = dict(scaling=0.25, softcap=None if why == "uncapped" else (200.0 if why == "large_cap" else 2.0))
    if why == "dropout":
        kw["dropout_p"] = 0.1
    if why == "sink":
        kw["sink"] = torch.randn(4, generator=g)
    if why == "subclass":
        q, k, v = (x.detach().as_subclass(_Subclass).requires_grad_() for x in (q, k, v))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2 if why == "two_threads" else 1)
        out = chunked.chunked_attention(q, k, v, **kw)
        out.sum().backward()
    finally:
        torch.set_num_threads(threads)
    assert spy.calls == 0


def test_two_threads_take_the_tiled_passes_on_small_tiles(native):
    """The one thread rule (:func:`.native.eligible`) for the tiled passes too: a tile of at most PARALLEL_MAX logits
    takes them whatever the threads."""
    spy = _Spy(native)
    lean.NATIVE[0] = spy
    q, k, v = (torch.randn(1, 4, 20, 16, requires_grad=True) for _ in range(3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        chunked.chunked_attention(q, k, v, scaling=0.25, softcap=2.0).sum().backward()
    finally:
        torch.set_num_threads(threads)
    assert {"forward_f32", "backward_p_f32", "backward_ds_f32"} <= set(spy.names)


# ---- the one rule, the custom op ----


@pytest.mark.parametrize(
    "case, expected",
    [
        ("plain", True),
        ("float64", False),
        ("bfloat16", False),
        ("subclass", False),
        ("grad", False),
        ("grad_under_no_grad", True),
        ("compiling", False),
        ("off", False),
        ("two_threads_small", True),
        ("two_threads_large", False),
        ("one_thread_large", True),
    ],
)
def test_the_eligibility_rule(native, monkeypatch, case, expected):
    q, k, v = _inputs(1, 4, 2, 8, 16)
    logits, threads, grad = 64, 1, torch.enable_grad()
    if case in ("float64", "bfloat16"):
        k = k.to(torch.float64 if case == "float64" else torch.bfloat16)
    if case == "subclass":
        v = v.as_subclass(_Subclass)
    if case.startswith("grad"):
        q.requires_grad_(True)
        grad = torch.no_grad() if case == "grad_under_no_grad" else grad
    if case == "compiling":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    if case == "off":
        lean.NATIVE[0] = None
    if case.endswith("large"):
        logits = native_op.PARALLEL_MAX + 1
    if case.startswith("two_threads"):
        threads = 2
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with grad:
            assert native_op.eligible(q, k, v, logits) is expected
    finally:
        torch.set_num_threads(saved)


def test_the_custom_op_matches_the_reference_and_passes_opcheck(native):
    q, k, v = _inputs(2, 4, 2, 33, 16, seed=3)
    mask = torch.rand(2, 1, 1, 33, generator=torch.Generator().manual_seed(4)) > 0.3
    got = torch.ops.hf_qknorm.capped_decode(q, k, v, mask, 0.3, 5.0)
    _assert_reference(got, q, k, v, mask=mask)
    torch.library.opcheck(native_op.capped_decode, (q, k, v, mask, 0.3, 5.0))
    torch.library.opcheck(native_op.capped_decode, (q, k, v, None, 0.3, 5.0))


def test_the_custom_op_traces_under_torch_compile_without_a_graph_break(native):
    """``torch.compile(fullgraph=True)`` traces the op through its fake implementation (no graph break) and the
    compiled call gives the eager op's values."""
    q, k, v = _inputs(1, 4, 2, 20, 16, seed=5)

    def step(q, k, v):
        return torch.ops.hf_qknorm.capped_decode(q * 1.0, k, v, None, 0.3, 5.0) + 0.0

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), step(q, k, v), rtol=0, atol=0)

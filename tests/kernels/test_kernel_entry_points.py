"""The kernels' public entry points (hf_qknorm.kernels.attn_interface): one per calling shape, one return type each.

Checked against the float64 reference (outputs and per-head max logits), against each other (the ``_with_max_logits``
variants return exactly the plain output; the KV-cache entry point really runs the decoding forward), under
``torch.compile(fullgraph=True)`` and ``opcheck``.
Kernel numerics in depth are tests/kernels/test_kernels.py's job; here shapes are tiny (the interpreter runs them).
"""

from __future__ import annotations

import pytest
import torch

from hf_qknorm import kernels
from hf_qknorm.kernels import attention as attn_mod
from hf_qknorm.kernels import attn_interface as api
from hf_qknorm.reference import allowed_reference, attention_reference
from tests.kernels.conftest import DEVICE

TOL = 1e-4  # relative to the largest reference value (fp32 kernels against float64)


def _qkv(b, h, hkv, tq, tk, d=32, *, scale=2.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, tq, d, generator=g) * scale
    k = torch.randn(b, hkv, tk, d, generator=g) * scale
    v = torch.randn(b, hkv, tk, d, generator=g)
    return [t.to(DEVICE) for t in (q, k, v)]


def _close(a, ref):
    assert ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(0.1)).item() < TOL


def _max_logits_reference(q, k, *, scaling, causal=True, sliding_window=None, mask=None):
    """Per-head max of the float64 pre-cap logits over the allowed pairs (-inf where a head has none)."""
    k = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = scaling * (q.double() @ k.transpose(-1, -2))
    ok = allowed_reference(q.shape[2], k.shape[2], causal=causal, sliding_window=sliding_window, mask=mask)
    return s.masked_fill(~ok.to(s.device), float("-inf")).amax(dim=(0, 2, 3))


def test_public_names():
    assert set(kernels.__all__) >= {
        "qknorm_attn_func",
        "qknorm_attn_varlen_func",
        "qknorm_attn_with_kvcache",
        "qknorm_attn_func_with_max_logits",
        "qknorm_attn_varlen_func_with_max_logits",
        "AttnOutputWithMaxLogits",
    }
    assert kernels.qknorm_attn_func is api.qknorm_attn_func


def test_padded_entry_point_and_its_max_logits():
    q, k, v = _qkv(2, 4, 2, 19, 23, seed=1)
    mask = torch.ones(2, 1, 1, 23, dtype=torch.bool, device=DEVICE)
    mask[1, ..., :7] = False  # left padding in row 1
    kw = dict(scaling=32**-0.5, softcap=3.0, causal=True, attn_mask=mask, sliding_window=9)
    out = api.qknorm_attn_func(q, k, v, **kw)
    assert type(out) is torch.Tensor and out.shape == q.shape and out.dtype == q.dtype
    ref = attention_reference(
        q.double(), k.double(), v.double(), scaling=32**-0.5, softcap=3.0, causal=True, mask=mask, sliding_window=9
    )
    _close(out, ref)
    both = api.qknorm_attn_func_with_max_logits(q, k, v, **kw)
    assert isinstance(both, api.AttnOutputWithMaxLogits) and both._fields == ("out", "max_logits")
    assert torch.equal(both.out, out)
    assert both.max_logits.shape == (4,) and both.max_logits.dtype == torch.float32
    assert not both.max_logits.requires_grad
    want = _max_logits_reference(q, k, scaling=32**-0.5, sliding_window=9, mask=mask)
    torch.testing.assert_close(both.max_logits.double(), want, rtol=1e-5, atol=1e-5)
    assert want.max() > 3.0  # the pre-cap maximum is above the cap: a post-cap value would fail the check


def test_scaling_defaults_to_head_dim():
    q, k, v = _qkv(1, 2, 1, 5, 5, d=16, seed=2)
    assert torch.equal(
        api.qknorm_attn_func(q, k, v, softcap=4.0), api.qknorm_attn_func(q, k, v, scaling=0.25, softcap=4.0)
    )


def test_varlen_entry_point_and_its_max_logits():
    lens = [5, 1, 9]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    q, k, v = _qkv(1, 4, 2, sum(lens), sum(lens), seed=3)
    out = api.qknorm_attn_varlen_func(q, k, v, cu, cu, softcap=5.0)  # max_seqlen computed from cu_seqlens
    assert type(out) is torch.Tensor
    both = api.qknorm_attn_varlen_func_with_max_logits(q, k, v, cu, cu, max(lens), max(lens), softcap=5.0)
    assert torch.equal(both.out, out)
    want = torch.full((4,), float("-inf"), dtype=torch.float64)
    for i in range(len(lens)):
        a, b = cu[i].item(), cu[i + 1].item()
        ref = attention_reference(*(t[:, :, a:b].double() for t in (q, k, v)), scaling=32**-0.5, softcap=5.0)
        _close(out[:, :, a:b], ref)
        want = torch.maximum(want, _max_logits_reference(q[:, :, a:b], k[:, :, a:b], scaling=32**-0.5).cpu())
    torch.testing.assert_close(both.max_logits.double().cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.fixture
def decode_calls(monkeypatch):
    """How many times the decoding forward ran."""
    calls = []
    original = attn_mod._decode_fwd
    monkeypatch.setattr(attn_mod, "_decode_fwd", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    return calls


def test_kvcache_entry_point_runs_the_decoding_forward(decode_calls):
    """A decoding shape (3 queries x 8 query heads per KV head = 24 rows, at most 64): both the KV-cache and the
    padded entry point run the decoding forward. 80 rows per KV head: only the KV-cache entry point does. Both
    forwards agree with the reference, and gradients flow through the KV-cache entry point."""
    q, k, v = _qkv(2, 8, 1, 3, 70, seed=4)
    mask = torch.ones(2, 1, 1, 70, dtype=torch.bool, device=DEVICE)
    mask[0, ..., :11] = False
    ref = attention_reference(q.double(), k.double(), v.double(), scaling=0.2, softcap=4.0, causal=True, mask=mask)
    _close(api.qknorm_attn_with_kvcache(q, k, v, scaling=0.2, softcap=4.0, attn_mask=mask, num_splits=3), ref)
    assert len(decode_calls) == 1
    _close(api.qknorm_attn_func(q, k, v, scaling=0.2, softcap=4.0, attn_mask=mask), ref)
    assert len(decode_calls) == 2  # decoding-shaped: the padded entry point picks the same forward by itself
    q, k, v = _qkv(1, 4, 1, 20, 40, seed=5)  # 80 rows per KV head: the padded entry point's general forward
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = api.qknorm_attn_with_kvcache(*leaves, scaling=0.2, softcap=4.0, sliding_window=13)
    assert len(decode_calls) == 3
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*ref_leaves, scaling=0.2, softcap=4.0, causal=True, sliding_window=13)
    _close(out, ref)
    general = api.qknorm_attn_func(q, k, v, scaling=0.2, softcap=4.0, sliding_window=13)
    assert len(decode_calls) == 3
    _close(general, ref)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    out.backward(g)
    ref.backward(g.double())
    for a, r in zip(leaves, ref_leaves):
        _close(a.grad, r.grad)


@pytest.mark.parametrize("num_splits", [0, -1, 2.0, True])
def test_kvcache_refuses_a_bad_num_splits(num_splits):
    q, k, v = _qkv(1, 2, 1, 1, 8)
    with pytest.raises(ValueError, match=f"num_splits must be a positive int or None .*got {num_splits!r}"):
        api.qknorm_attn_with_kvcache(q, k, v, num_splits=num_splits)


def test_opcheck_forced_paths():
    """The forward ops' path arguments (decode, num_splits) keep the op contract, fake and autograd included."""
    from torch.library import opcheck

    q, k, v = (t.requires_grad_() for t in _qkv(2, 2, 1, 3, 40, seed=7))  # GQA 2:1
    mask = torch.ones(2, 1, 1, 40, dtype=torch.bool, device=DEVICE)
    for op in (torch.ops.hf_qknorm.attn_fwd.default, torch.ops.hf_qknorm.attn_fwd_max.default):
        opcheck(op, (q, k, v, mask, None, None, 3, 40, 0.2, 3.0, True, None, True, 2))
        opcheck(op, (q, k, v, None, None, None, 3, 40, 0.2, None, True, 7, False, None))


@pytest.mark.parametrize("entry", ["func", "func_with_max_logits", "varlen_func", "with_kvcache"])
def test_entry_points_under_torch_compile(entry):
    """fullgraph=True: each entry point is one custom-op node, forward and backward (aot_eager)."""
    q, k, v = _qkv(1, 2, 1, 11, 11, seed=8)
    cu = torch.tensor([0, 4, 11], dtype=torch.int32, device=DEVICE)
    fns = {
        "func": lambda a, b, c: api.qknorm_attn_func(a, b, c, scaling=0.2, softcap=3.0),
        "func_with_max_logits": lambda a, b, c: (
            api.qknorm_attn_func_with_max_logits(a, b, c, scaling=0.2, softcap=3.0).out
        ),
        "varlen_func": lambda a, b, c: api.qknorm_attn_varlen_func(a, b, c, cu, cu, 7, 7, scaling=0.2, softcap=3.0),
        "with_kvcache": lambda a, b, c: api.qknorm_attn_with_kvcache(a, b, c, scaling=0.2, softcap=3.0),
    }
    torch._dynamo.reset()
    compiled = torch.compile(fns[entry], backend="aot_eager", fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    eager_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, expected = compiled(*leaves), fns[entry](*eager_leaves)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out.backward(g)
    expected.backward(g)
    for a, b in zip(leaves, eager_leaves):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)

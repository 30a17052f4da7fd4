"""The PyTorch attention path: chunked capped attention and the "qknorm" interface function."""

from __future__ import annotations

import pytest
import torch

from hf_qknorm.attention.chunked import chunked_attention
from hf_qknorm.attention.interface import qknorm_attention_forward
from hf_qknorm.reference import allowed_reference, attention_reference


class _Mod(torch.nn.Module):
    is_causal = True


def _qkv(b, h, hkv, tq, tk, d, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = scale * torch.randn(b, h, tq, d, generator=g, dtype=torch.float64)
    k = scale * torch.randn(b, hkv, tk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, tk, d, generator=g, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("tq,tk", [(1, 1), (17, 17), (113, 113), (1, 40), (7, 30)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("keep_tanh", ["all", "part", "none"], ids=["tanh-kept", "tanh-part-kept", "tanh-recomputed"])
def test_chunked_matches_reference(tq, tk, causal, window, keep_tanh, monkeypatch):
    import hf_qknorm.attention.chunked as chunked
    import hf_qknorm.attention.tiles as tiles

    # none: every call above the budget, backward recomputes the logits and their tanh; part: about half the tiles
    monkeypatch.setattr(chunked, "KEEP_TANH_MAX", {"all": 1 << 22, "part": 2 * 4 * tq * tk // 2, "none": 0}[keep_tanh])
    monkeypatch.setattr(tiles, "TILE_ELEMENTS", 2 * 16 * tk)  # force several tiles
    monkeypatch.setattr(tiles, "QUERY_ROWS", 8)
    q, k, v = _qkv(2, 4, 2, tq, tk, 16, scale=3.0)
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(2, 1, tq, tk, generator=g) > 0.2
    for m in (None, mask):
        args = (q.clone().requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_())
        out = chunked_attention(*args, scaling=0.25, softcap=2.0, mask=m, causal=causal, sliding_window=window)
        ref_args = tuple(a.clone().requires_grad_() for a in (q, k, v))
        ref = attention_reference(*ref_args, scaling=0.25, softcap=2.0, causal=causal, mask=m, sliding_window=window)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        go = torch.randn_like(out)
        for a, b in zip(torch.autograd.grad(out, args, go), torch.autograd.grad(ref, ref_args, go)):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_cap_really_engages():
    q, k, v = _qkv(1, 2, 2, 9, 9, 16, scale=3.0)
    s = 0.25 * q @ k.transpose(-1, -2)
    assert (s.abs() > 2.0).float().mean() > 0.2  # many logits beyond the cap
    capped = chunked_attention(q, k, v, scaling=0.25, softcap=2.0)
    plain = chunked_attention(q, k, v, scaling=0.25, softcap=None)
    assert (capped - plain).abs().max() > 1e-2


@pytest.mark.parametrize("keep_tanh", [True, False], ids=["tanh-kept", "tanh-recomputed"])
def test_gradcheck_chunked(keep_tanh, monkeypatch):
    import hf_qknorm.attention.chunked as chunked

    if not keep_tanh:
        monkeypatch.setattr(chunked, "KEEP_TANH_MAX", 0)
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 1, 5, 5, 4, scale=2.0))
    mask = torch.tensor([True, True, False, True, True]).expand(1, 1, 5, 5)
    fn = lambda q, k, v: chunked_attention(q, k, v, scaling=0.5, softcap=1.5, mask=mask, causal=True)
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_fully_masked_rows_give_zeros_not_nan():
    q, k, v = _qkv(1, 1, 1, 4, 4, 8)
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    mask[..., 2:, :] = True
    q.requires_grad_()
    out = chunked_attention(q, k, v, scaling=1.0, softcap=5.0, mask=mask, causal=False)
    assert torch.equal(out[..., :2, :], torch.zeros_like(out[..., :2, :]))
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_dropout_is_consistent_between_forward_and_backward():
    """With dropout the backward must see the same mask as the forward: compare to autograd through a
    re-run of the forward with the same RNG state."""
    q, k, v = _qkv(1, 2, 2, 12, 12, 8, scale=2.0)
    q.requires_grad_()
    torch.manual_seed(7)
    out = chunked_attention(q, k, v, scaling=0.3, softcap=2.0, dropout_p=0.3)
    (gq,) = torch.autograd.grad((out * out).sum(), q)
    # finite differences along a random direction, with the dropout mask held fixed by re-seeding
    direction = torch.randn_like(q)
    eps = 1e-6

    def f(x):
        torch.manual_seed(7)
        o = chunked_attention(x, k, v, scaling=0.3, softcap=2.0, dropout_p=0.3)
        return (o * o).sum()

    fd = (f(q.detach() + eps * direction) - f(q.detach() - eps * direction)) / (2 * eps)
    torch.testing.assert_close((gq * direction).sum(), fd, rtol=1e-5, atol=1e-6)
    torch.manual_seed(7)
    again = chunked_attention(q.detach(), k, v, scaling=0.3, softcap=2.0, dropout_p=0.3)
    assert torch.equal(again, out.detach())
    assert not torch.equal(again, chunked_attention(q.detach(), k, v, scaling=0.3, softcap=2.0))


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_interface_function_gqa_and_layout(softcap):
    q, k, v = _qkv(2, 6, 2, 10, 10, 8, scale=2.0)
    out, weights = qknorm_attention_forward(_Mod(), q, k, v, None, scaling=0.4, softcap=softcap)
    assert weights is None and out.shape == (2, 10, 6, 8)  # (batch, seq, heads, head_dim)
    ref = attention_reference(q, k, v, scaling=0.4, softcap=softcap, causal=True)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_interface_packed_cu_seq_lens(softcap):
    q, k, v = _qkv(1, 2, 2, 12, 12, 8)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    out, _ = qknorm_attention_forward(
        _Mod(), q, k, v, None, scaling=0.4, softcap=softcap, cu_seq_lens_q=cu, cu_seq_lens_k=cu
    )
    for a, b in ((0, 5), (5, 12)):
        ref = attention_reference(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], scaling=0.4, softcap=softcap)
        torch.testing.assert_close(out[:, a:b], ref.transpose(1, 2), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_interface_sliding_window_and_float_mask(softcap):
    q, k, v = _qkv(1, 2, 1, 9, 9, 8)
    out, _ = qknorm_attention_forward(_Mod(), q, k, v, None, scaling=0.4, softcap=softcap, sliding_window=3)
    ref = attention_reference(q, k, v, scaling=0.4, softcap=softcap, sliding_window=3)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-10, atol=1e-10)
    allowed = allowed_reference(9, 9, causal=True)
    additive = torch.zeros(1, 1, 9, 9, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    out, _ = qknorm_attention_forward(_Mod(), q, k, v, additive, scaling=0.4, softcap=softcap)
    ref = attention_reference(q, k, v, scaling=0.4, softcap=softcap)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-10, atol=1e-10)


def _flash_rule_errors(dtype, cap, scale, seed=0):
    """(error of the tiled path, error of the same-dtype PyTorch reference) against float64, output and gradients."""
    g = torch.Generator().manual_seed(seed)
    b, h, hkv, t, d = 2, 4, 2, 70, 64
    q64, k64 = (scale * torch.randn(b, n, t, d, generator=g, dtype=torch.float64) for n in (h, hkv))
    v64 = torch.randn(b, hkv, t, d, generator=g, dtype=torch.float64)
    do = torch.randn(b, h, t, d, generator=g, dtype=torch.float64)
    ref_in = [x.clone().requires_grad_() for x in (q64, k64, v64)]
    ref = attention_reference(*ref_in, scaling=d**-0.5, softcap=cap)
    ref_grads = torch.autograd.grad(ref, ref_in, do)
    errors = []
    for fn in (
        lambda q, k, v: chunked_attention(q, k, v, scaling=d**-0.5, softcap=cap),
        lambda q, k, v: attention_reference(q, k, v, scaling=d**-0.5, softcap=cap),
    ):
        low = [x.to(dtype).requires_grad_() for x in (q64, k64, v64)]
        out = fn(*low)
        grads = torch.autograd.grad(out, low, do.to(dtype))
        errors.append([(a.double() - r).abs().max().item() for a, r in zip((out, *grads), (ref, *ref_grads))])
    return errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cap,scale", [(50.0, 1.0), (50.0, 4.0), (2.0, 3.0), (None, 2.0)])
def test_low_precision_flash_rule(dtype, cap, scale):
    """Flash-attention's rule: the tiled path's error against float64 is at most 3x (a cap) or 2x that of the
    same-dtype PyTorch reference, plus a small atol. (50, 1.0): a large cap over small logits, where tanh written as
    2*sigmoid(2x) - 1 would lose digits to cancellation and break the rule in float32."""
    tiled, torch_ref = _flash_rule_errors(dtype, cap, scale)
    factor, atol = (3.0 if cap else 2.0), (1e-6 if dtype == torch.float32 else 1e-3)
    for name, a, r in zip(("out", "dq", "dk", "dv"), tiled, torch_ref):
        assert a <= factor * r + atol, (name, a, r)


def _saved_elements(fn) -> int:
    """How many elements the autograd graph of ``fn()`` keeps for backward."""
    sizes = []

    def pack(x):
        sizes.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return sum(sizes)


def test_capped_calls_keep_the_tanh_of_the_tiles_within_the_budget(monkeypatch):
    """A capped call that needs a gradient keeps the tanh of its first tiles, as many as fit KEEP_TANH_MAX logits
    (backward skips their logits' matmul and tanh; all of them in a small call), and recomputes the rest: what it
    saves beyond O(T) never exceeds the budget. Kept, partly kept or recomputed, the output is the same bits and the
    gradients agree; no call without a cap, without a gradient, or under no_grad keeps anything."""
    import hf_qknorm.attention.chunked as chunked
    import hf_qknorm.attention.tiles as tiles

    monkeypatch.setattr(tiles, "TILE_ELEMENTS", 2 * 4 * 8 * 40)  # several tiles
    monkeypatch.setattr(tiles, "QUERY_ROWS", 8)
    q, k, v = _qkv(2, 4, 2, 40, 40, 8, scale=3.0, seed=3)
    q, k, v = q.float().requires_grad_(), k.float().requires_grad_(), v.float().requires_grad_()

    def run(softcap=2.0):
        out = chunked_attention(q, k, v, scaling=0.3, softcap=softcap, causal=True)
        grads = torch.autograd.grad((out * out).sum(), (q, k, v))
        return out, grads

    # O(T): the call's q, k, v, out and row lse (b * h * tq), and out twice for the loss's out * out
    o_t = 4 * q.numel() + 2 * k.numel() + q.shape[0] * q.shape[1] * q.shape[2]
    monkeypatch.setattr(chunked, "KEEP_TANH_MAX", 0)
    assert _saved_elements(run) == o_t
    recomputed = run()
    monkeypatch.setattr(chunked, "KEEP_TANH_MAX", 1 << 22)
    logits = _saved_elements(run) - o_t
    assert logits >= 2 * 4 * 40 * 41 // 2  # causal: every tile's logits, the diagonal blocks whole
    kept = run()
    monkeypatch.setattr(chunked, "KEEP_TANH_MAX", logits // 2)
    partly = _saved_elements(run) - o_t
    assert 0 < partly <= logits // 2  # some tiles kept, within the budget
    partly_kept = run()
    for other in (recomputed, partly_kept):
        torch.testing.assert_close(other[0], kept[0], rtol=0, atol=0)
        for a, b in zip(other[1], kept[1]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    monkeypatch.setattr(chunked, "KEEP_TANH_MAX", 1 << 22)
    assert _saved_elements(lambda: run(softcap=None)) == o_t  # nothing to keep without a cap
    with torch.no_grad():
        assert _saved_elements(lambda: chunked_attention(q, k, v, scaling=0.3, softcap=2.0)) == 0

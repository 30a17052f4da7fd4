"""The split key and query loops of the attention kernels: blocks that every row of a tile may see run unmasked.

``_key_range`` (forward and dQ) and ``_query_range`` (dK/dV) cut each tile's loop into masked edges (the window's
left edge, the diagonal, the sequence's end) and an unmasked middle. Two kinds of checks, both under Triton's
interpreter on CPU (or compiled on a GPU):

* the ranges themselves, for every tile of many shapes: the three loops visit exactly the blocks of one loop, every
  allowed (query, key) pair lies in a visited block, every unmasked block is allowed in full, and no block that is
  allowed in full is left to a masked loop (the split is as wide as it can be);
* the kernels against the float64 reference, forward and backward, at lengths that are and are not multiples of
  the tile, with windows at and around the tile's size, q_len above and below kv_len, GQA, packed sequences.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import triton
import triton.language as tl

from hf_qknorm.kernels import attention as attn_mod
from hf_qknorm.kernels._attention_kernels import _key_range, _query_range
from hf_qknorm.reference import allowed_reference, attention_reference
from tests.kernels.conftest import DEVICE

TOL = 1e-4  # relative to the largest reference value (fp32 kernels against float64)


@triton.jit
def _ranges_probe(
    OUT,
    q_len,
    k_len,
    window,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Program i writes ``_key_range`` of query block i and ``_query_range`` of key block i (8 int32)."""
    i = tl.program_id(0)
    diag = k_len - q_len
    zero = i * 0  # a tensor: the ranges may come back as Python ints
    lo, mid_lo, mid_hi, hi = _key_range(i * BLOCK_M, k_len, diag, window, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW)
    tl.store(OUT + i * 8 + 0, zero + lo)
    tl.store(OUT + i * 8 + 1, zero + mid_lo)
    tl.store(OUT + i * 8 + 2, zero + mid_hi)
    tl.store(OUT + i * 8 + 3, zero + hi)
    lo, mid_lo, mid_hi, hi = _query_range(
        i * BLOCK_N, q_len, k_len, diag, window, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW
    )
    tl.store(OUT + i * 8 + 4, zero + lo)
    tl.store(OUT + i * 8 + 5, zero + mid_lo)
    tl.store(OUT + i * 8 + 6, zero + mid_hi)
    tl.store(OUT + i * 8 + 7, zero + hi)


def _ranges(q_len, k_len, window, bm, bn, causal):
    programs = max(triton.cdiv(q_len, bm), triton.cdiv(k_len, bn))
    out = torch.full((programs, 8), -1, dtype=torch.int32, device=DEVICE)
    _ranges_probe[(programs,)](
        out, q_len, k_len, window or 0, BLOCK_M=bm, BLOCK_N=bn, IS_CAUSAL=causal, HAS_WINDOW=window is not None
    )
    return out.tolist()


def _check_split(lo, mid_lo, mid_hi, hi, step, allowed, full):
    """One tile's ranges: ``allowed[j]``, block ``lo + j * step`` is allowed for every real pair (so it may run
    unmasked); ``full[j]``, for every pair the kernel judges the tile by (so it should). Returns the visited starts."""
    visited = [*range(lo, mid_lo, step), *range(mid_lo, mid_hi, step), *range(mid_hi, hi, step)]
    assert lo <= mid_lo <= mid_hi, (lo, mid_lo, mid_hi, hi)
    assert visited == list(range(lo, hi, step)), (lo, mid_lo, mid_hi, hi)
    unmasked = range(mid_lo, mid_hi, step)
    for j, b in enumerate(visited):
        if b in unmasked:
            assert allowed[j], (
                f"block {b} runs unmasked but not every pair in it is allowed: {(lo, mid_lo, mid_hi, hi)}"
            )
        else:
            assert not full[j], f"block {b} is allowed in full but masked: {(lo, mid_lo, mid_hi, hi)}"
    return visited


def _check_query_tile(ranges, m0, bm, bn, ok, ext):
    """Query tile ``[m0, m0 + bm)``'s key loop (forward, dQ). ``ok``: the real rows' allowed pairs; ``ext``: the
    geometry extended past q_len, by which the kernel judges the tile (rows past q_len are zeros, never stored)."""
    k_len = ok.shape[1]
    lo, _, _, hi = ranges
    starts = range(lo, hi, bn)
    real = ok[m0 : m0 + bm]
    allowed = [b + bn <= k_len and bool(real[:, b : b + bn].all()) for b in starts]
    full = [b + bn <= k_len and bool(ext[m0 : m0 + bm, b : b + bn].all()) for b in starts]
    visited = _check_split(*ranges, bn, allowed, full)
    needed = {c // bn * bn for c in real.any(0).nonzero().flatten().tolist()}
    assert needed <= set(visited), f"allowed keys in blocks {sorted(needed - set(visited))} are never visited"


def _check_key_tile(ranges, n0, bm, bn, ok):
    """Key tile ``[n0, n0 + bn)``'s query loop (dK/dV): every row and key the kernel reads is real here."""
    q_len, k_len = ok.shape
    lo, _, _, hi = ranges
    full = [
        b + bm <= q_len and n0 + bn <= k_len and bool(ok[b : b + bm, n0 : n0 + bn].all()) for b in range(lo, hi, bm)
    ]
    visited = _check_split(*ranges, bm, full, full)
    needed = {r // bm * bm for r in ok[:, n0 : n0 + bn].any(1).nonzero().flatten().tolist()}
    assert needed <= set(visited), f"queries in blocks {sorted(needed - set(visited))} are never visited"


SHAPES = [(64, 64), (65, 65), (31, 31), (1, 40), (40, 1), (17, 113), (113, 17), (100, 64), (48, 80)]
WINDOWS = [None, 1, 15, 16, 17, 33, 64, 200]
BLOCKS = [(16, 16), (16, 32), (32, 16)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_split_ranges(causal):
    """Every tile of every shape: the split visits the same blocks as one loop, covers every allowed pair, runs
    unmasked only blocks allowed in full, and masks no block that is allowed in full."""
    unmasked = 0  # tiles with at least one unmasked block: the split must actually happen
    for (q_len, k_len), window, (bm, bn) in itertools.product(SHAPES, WINDOWS, BLOCKS):
        ext = _geometry(q_len + bm, k_len, k_len - q_len, causal, window)
        ok = ext[:q_len]
        assert torch.equal(ok, allowed_reference(q_len, k_len, causal=causal, sliding_window=window).reshape(ok.shape))
        for i, row in enumerate(_ranges(q_len, k_len, window, bm, bn, causal)):
            if i * bm < q_len:
                _check_query_tile(row[:4], i * bm, bm, bn, ok, ext)
                unmasked += row[2] > row[1]
            if i * bn < k_len:
                _check_key_tile(row[4:], i * bn, bm, bn, ok)
                unmasked += row[6] > row[5]
    assert unmasked > 200, unmasked


def _geometry(rows, k_len, diag, causal, window):
    """Which keys query rows ``0..rows-1`` may see (rows past q_len too), query ``i`` at position ``i + diag``."""
    r = torch.arange(rows)[:, None] + diag
    c = torch.arange(k_len)[None, :]
    ok = torch.ones(rows, k_len, dtype=torch.bool)
    if causal:
        ok &= c <= r
    if window is not None:
        ok &= r - c < window
    return ok


def _qkv(b, h, hkv, tq, tk, d, *, scale, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, tq, d, generator=g) * scale
    k = torch.randn(b, hkv, tk, d, generator=g) * scale
    v = torch.randn(b, hkv, tk, d, generator=g)
    do = torch.randn(b, h, tq, d, generator=g)
    return [t.to(DEVICE) for t in (q, k, v, do)]


def _rel_err(a, ref):
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(0.1)).item()


def _reference(q, k, v, do, **kw):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = attention_reference(*leaves, **kw)
    out.backward(do.double())
    return out.detach(), [t.grad for t in leaves]


# (heads, kv_heads, q_len, kv_len, causal, softcap, window, (block_m, block_n))
LOOP_CASES = {
    "causal-tile-multiple": (2, 1, 64, 64, True, 5.0, None, (16, 16)),
    "causal-off-tile": (2, 2, 65, 65, True, 5.0, None, (16, 32)),
    "causal-more-keys": (2, 1, 33, 97, True, None, None, (32, 16)),
    "causal-more-queries-empty-rows": (2, 1, 80, 48, True, 5.0, None, (16, 16)),
    "window-equals-block": (2, 1, 48, 80, True, 5.0, 16, (16, 16)),
    "window-block-plus-one": (2, 2, 80, 48, True, 5.0, 17, (32, 16)),
    "window-block-minus-one": (2, 1, 64, 64, True, None, 15, (16, 16)),
    "window-one": (2, 1, 40, 40, True, 5.0, 1, (16, 16)),
    "window-noncausal-one": (1, 1, 50, 50, False, 5.0, 1, (16, 16)),
    "window-noncausal-33": (2, 1, 95, 70, False, 5.0, 33, (16, 32)),
    "window-wider-than-keys": (2, 1, 40, 40, True, 5.0, 200, (16, 16)),
    "noncausal-tile-multiple": (2, 1, 96, 96, False, 5.0, None, (32, 32)),
    "noncausal-off-tile": (2, 1, 95, 95, False, None, None, (32, 16)),
}


@pytest.mark.parametrize("case", list(LOOP_CASES), ids=list(LOOP_CASES))
def test_split_loops_match_reference(case):
    """Forward and backward against float64 where tiles are wholly allowed, cut by the diagonal, the window's edge
    and the sequence's end, with a cap that engages (the unmasked loop skips the mask, not the cap)."""
    h, hkv, tq, tk, causal, cap, window, (bm, bn) = LOOP_CASES[case]
    d = 16
    q, k, v, do = _qkv(1, h, hkv, tq, tk, d, scale=math.sqrt(cap) if cap else 1.0, seed=len(case))
    kw = dict(scaling=d**-0.5, softcap=cap, causal=causal, sliding_window=window)
    ref, ref_grads = _reference(q, k, v, do, **kw)
    out, lse = attn_mod.attn_fwd(q, k, v, **kw, block_m=bm, block_n=bn, decode=False)
    grads = attn_mod.attn_bwd(do, q, k, v, out, lse, **kw, block_m=bm, block_n=bn)
    assert _rel_err(out, ref) < TOL
    for name, g, r in zip("qkv", grads, ref_grads):
        assert torch.isfinite(g).all(), f"d{name} has non-finite values"
        assert _rel_err(g, r) < TOL, f"d{name}"
    if causal and tq > tk:
        assert (out[:, :, : tq - tk] == 0).all() and (grads[0][:, :, : tq - tk] == 0).all()


def test_split_loops_packed_sequences():
    """Packed sequences whose lengths are and are not multiples of the tile, each a different mix of unmasked and
    masked blocks; the rows past the last sequence stay zero."""
    lens = [48, 33, 16, 1, 50]
    cu = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    total = sum(lens) + 5
    q, k, v, do = _qkv(1, 2, 1, total, total, 16, scale=math.sqrt(5.0), seed=3)
    kw = dict(scaling=0.25, softcap=5.0, causal=True, sliding_window=20)
    packed = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    out, lse = attn_mod.attn_fwd(q, k, v, **kw, **packed, block_m=16, block_n=16)
    dq, dk, dv = attn_mod.attn_bwd(do, q, k, v, out, lse, **kw, **packed, block_m=16, block_n=16)
    for i in range(len(lens)):
        s, e = cu[i].item(), cu[i + 1].item()
        sl = slice(s, e)
        ref, (rq, rk, rv) = _reference(q[:, :, sl], k[:, :, sl], v[:, :, sl], do[:, :, sl], **kw)
        assert _rel_err(out[:, :, sl], ref) < TOL, f"sequence {i}"
        for name, g, r in zip("qkv", (dq, dk, dv), (rq, rk, rv)):
            assert _rel_err(g[:, :, sl], r) < TOL, f"d{name}, sequence {i}"
    assert (out[:, :, sum(lens) :] == 0).all() and (dq[:, :, sum(lens) :] == 0).all()

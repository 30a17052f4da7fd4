"""Tiling of the PyTorch attention path (:mod:`.chunked`): which (query block, key range) tiles exist, and which of
their pairs a mask hides.

Layout. Queries are packed per key/value head (FlashAttention-3's "pack GQA"): ``(batch * kv_heads, q_len *
groups, head_dim)``, row ``r * groups + j`` being query position ``r`` of the group's ``j``-th query head, so the
heads that share a key head share one matmul against it and K/V are never repeated. A tile is ``(n0, n1, r0, r1,
lo, hi, edges)``: rows ``n0:n1`` of the ``batch * kv_heads`` axis, query positions ``r0:r1``, keys ``lo:hi``.

Skipping. Keys a causal row can never see (past its diagonal) and keys behind a sliding window are outside
``lo:hi``: skipped, not masked. Inside the tile only the columns where the pattern cuts through -- the diagonal block,
the window's trailing edge -- need a mask; ``edges`` lists those column ranges, everything else is fully allowed.
Causality and windows are bottom-right aligned: query ``r`` sits at absolute position ``r + kv_len - q_len``.

This module imports nothing but ``torch``.
"""

from __future__ import annotations

import torch

# Elements of one (rows, heads, queries, keys) logits tile: 2**19 float32 = 2 MiB, about one core's L2 cache, so the
# elementwise passes over a tile run from cache. Measured best of 2**19..2**21 (benchmarks/bench_cpu.py).
TILE_ELEMENTS = 1 << 19
# Packed query rows per block: large enough for efficient matmuls, small enough that the causal diagonal block (the
# only part computed and then masked) stays a small part of the work: at most QUERY_ROWS, and about q_len / 8
# (not below MIN_QUERY_ROWS) for short sequences. Measured against sdpa at T = 256..2048 (benchmarks/bench_cpu.py).
QUERY_ROWS = 128
MIN_QUERY_ROWS = 32


# expm1 overflows float32 past ~88; tanh(20) is 1 to float64 precision, so clamping 2x at 40 changes nothing.
TANH_CLAMP = 40.0


def expm1_doubled_(x2: torch.Tensor, tmp: torch.Tensor, clamp: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e, e + 2)`` with ``e = expm1(2x)`` written over ``x2`` (which holds ``2x``) and ``e + 2`` into ``tmp``:
    ``tanh(x) = e / (e + 2)``. The capped paths' tanh: as exact as ``torch.tanh``, and cheaper per element where the
    elements are many (by how much depends on the CPU: benchmarks/results/tuning.md). ``2 * sigmoid(2x) - 1`` is
    shorter but loses digits to cancellation near 0:
    several times the float32 reference's error at c = 50."""
    if clamp:
        x2.clamp_(max=TANH_CLAMP)
    e = x2.expm1_()
    return e, torch.add(e, 2.0, out=tmp)


def tanh_doubled_(x2: torch.Tensor, tmp: torch.Tensor, clamp: bool = True) -> torch.Tensor:
    """``tanh(x)`` written over ``x2`` (which holds ``2x``); ``tmp`` is scratch of the same shape."""
    e, e2 = expm1_doubled_(x2, tmp, clamp)
    return e.div_(e2)


def key_range(start: int, end: int, q_len: int, kv_len: int, causal: bool, sliding_window: int | None):
    """Keys ``[lo, hi)`` that query positions ``[start, end)`` can see at all."""
    shift = kv_len - q_len
    lo, hi = 0, kv_len
    if causal:
        hi = max(0, min(kv_len, end + shift))
    if sliding_window is not None:
        lo = max(0, min(hi, start + shift - sliding_window + 1))
    return lo, hi


def edge_columns(start, end, lo, hi, q_len, kv_len, causal, sliding_window) -> tuple[tuple[int, int], ...]:
    """Key ranges (absolute, within ``[lo, hi)``) where some query of ``[start, end)`` is masked by causality or the
    window; the other keys of the tile are allowed for every query of the block."""
    shift = kv_len - q_len
    spans: list[list[int]] = []
    if sliding_window is not None:
        cut = min(hi, end + shift - sliding_window)  # keys >= cut are inside every row's window
        if cut > lo:
            spans.append([lo, cut])
    if causal:
        cut = max(lo, start + shift + 1)  # keys < cut are at or before every row's diagonal
        if cut < hi:
            if spans and spans[-1][1] >= cut:
                spans[-1][1] = hi
            else:
                spans.append([cut, hi])
    return tuple((a, b) for a, b in spans)


def plan(
    batch_heads: int,
    q_len: int,
    kv_len: int,
    groups: int,
    causal: bool,
    sliding_window: int | None,
    tile_elements: int | None = None,
    query_rows: int | None = None,
) -> list[tuple]:
    """The tiles of one call, in a fixed order (the backward replays them, dropout masks included)."""
    tile_elements = TILE_ELEMENTS if tile_elements is None else tile_elements
    if query_rows is None:
        query_rows = min(QUERY_ROWS, max(MIN_QUERY_ROWS, 1 << max(0, (q_len * groups // 8).bit_length() - 1)))
    block = max(1, query_rows // groups)
    tiles = []
    for start in range(0, q_len, block):
        end = min(q_len, start + block)
        lo, hi = key_range(start, end, q_len, kv_len, causal, sliding_window)
        if hi <= lo:
            continue
        edges = edge_columns(start, end, lo, hi, q_len, kv_len, causal, sliding_window)
        rows = max(1, min(batch_heads, tile_elements // ((end - start) * groups * (hi - lo))))
        for n0 in range(0, batch_heads, rows):
            tiles.append((n0, min(batch_heads, n0 + rows), start, end, lo, hi, edges))
    return tiles


def position_mask(start, end, c0, c1, q_len, kv_len, causal, sliding_window, device) -> torch.Tensor:
    """Boolean ``(end - start, c1 - c0)``: which keys ``[c0, c1)`` queries ``[start, end)`` may see."""
    pos = torch.arange(start, end, device=device)[:, None] + (kv_len - q_len)
    key = torch.arange(c0, c1, device=device)[None, :]
    ok = key <= pos if causal else torch.ones((), dtype=torch.bool, device=device)
    if sliding_window is not None:
        ok = ok & ((pos - key) < sliding_window)
    return ok.expand(end - start, c1 - c0)


def chunk_allowed(mask, start, end, q_len, kv_len, causal, sliding_window, device, lo=0, hi=None):
    """Boolean ``(.., end - start, hi - lo)`` of allowed pairs for query rows ``[start, end)`` and keys ``[lo, hi)``,
    or ``None`` (all allowed). ``mask``: boolean ``(B|1, 1|H, q_len, kv_len)`` (True = attend) or ``None``."""
    hi = kv_len if hi is None else hi
    ok = None
    if causal or sliding_window is not None:
        ok = position_mask(start, end, lo, hi, q_len, kv_len, causal, sliding_window, device)
    if mask is not None:
        m = mask[..., start:end, lo:hi]
        ok = m if ok is None else ok & m
    return ok


def user_mask_tile(mask: torch.Tensor, tile, kv_heads: int, groups: int) -> torch.Tensor:
    """The part of a boolean ``(B|1, 1|H, q_len, kv_len)`` mask that covers ``tile``, shaped to broadcast against
    the tile's logits viewed as ``(rows, queries, groups, keys)``. Copies only the tile (advanced indexing)."""
    n0, n1, start, end, lo, hi, _ = tile
    m = mask[:, :, start:end, lo:hi]
    if m.shape[0] == 1 and m.shape[1] == 1:
        return m[0, 0][None, :, None, :]
    idx = torch.arange(n0, n1, device=mask.device)
    b = idx // kv_heads if m.shape[0] > 1 else torch.zeros_like(idx)
    if m.shape[1] == 1:
        return m[b, 0][:, :, None, :]
    heads = (idx % kv_heads)[:, None] * groups + torch.arange(groups, device=mask.device)
    return m[b[:, None], heads].transpose(1, 2)  # (rows, groups, queries, keys) -> (rows, queries, groups, keys)

"""The PyTorch attention path (any device without the Triton kernels): capped or not, memory linear in sequence
length, and the per-head largest logit as a by-product.

``sdpa`` cannot cap logits, and eager attention with a cap materialises several ``(batch, heads, q_len, kv_len)``
tensors and keeps them for backward (2 GiB at B=4, H=8, T=2048). :class:`TiledAttention` is FlashAttention's
recipe (Dao et al. 2022; FlashAttention-2's saved log-sum-exp) at the granularity of PyTorch ops: it walks cache-sized
tiles (:mod:`.tiles`), keeps only the output and the row log-sum-exp, and recomputes each tile's probabilities in
backward. What makes it fast on a CPU:

- every tile is one batched matmul per product, with the query heads of a GQA group packed against their shared key
  head, and keys a causal or windowed row never sees skipped rather than masked;
- the elementwise work is a few in-place passes over a tile that sits in cache: logits in the base-2 domain so the
  exponential is ``exp2`` (cheaper than ``exp``), and ``tanh`` through ``expm1``
  (``expm1(2x) / (expm1(2x) + 2)``: as exact as ``torch.tanh``, and cheaper per element on many; the shorter
  ``2*sigmoid(2x) - 1`` loses digits to cancellation near 0, several times the float32 reference's error at c=50);
- backward reuses the recomputed ``t = tanh`` for the cap's derivative ``1 - t^2``, and accumulates dK and dV
  transposed, the matmul layout MKL runs fastest;
- a capped call that needs a gradient keeps ``t`` from forward for its first tiles, as many as fit ``KEEP_TANH_MAX``
  logits (at most 16 MiB in float32, 32 in float64; every tile of a small call): backward then skips those tiles'
  matmul and tanh, about a third of its work per tile where ``head_dim`` is small. The other tiles recompute, so
  memory stays linear in sequence length (plus the bounded buffer).

The row maxima that stabilise the softmax are taken on the pre-cap logits, over allowed pairs only, so the largest
pre-cap logit of every head (QK-Clip's and the monitor's telemetry) comes out of the same pass
(``return_max_logits``).
"""

from __future__ import annotations

import math

import torch

from . import native
from . import tiles as _tiles
from .native import NATIVE
from .tiles import TANH_CLAMP, chunk_allowed, expm1_doubled_, position_mask, tanh_doubled_, user_mask_tile

__all__ = ["TiledAttention", "chunk_allowed", "chunked_attention", "max_logits"]

LOG2E = math.log2(math.e)


def _scratch(buf: torch.Tensor, shape) -> torch.Tensor:
    return buf[: math.prod(shape)].view(shape)


# Up to this many matrices, baddbmm_ writes straight into the strided destination (one GEMM call per matrix); beyond,
# one batched GEMM into contiguous scratch plus one pass into the destination is cheaper (figures:
# benchmarks/results/tuning.md).
_PER_MATRIX_MAX = 4


def _matmul_into(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, buf: torch.Tensor, accumulate: bool):
    """``dst (+)= a @ b`` for a batch of matrices; ``dst`` may be a strided view of a larger tensor."""
    if dst.shape[0] <= _PER_MATRIX_MAX:
        return dst.baddbmm_(a, b, beta=1.0 if accumulate else 0.0)
    prod = torch.bmm(a, b, out=_scratch(buf, dst.shape))
    return dst.add_(prod) if accumulate else dst.copy_(prod)


def _fill(x: torch.Tensor, masks, groups: int, value: float) -> None:
    """Set the pairs each ``(column slice, blocked)`` of ``masks`` blocks to ``value``."""
    x4 = x.view(x.shape[0], -1, groups, x.shape[-1])
    for cols, blocked in masks:
        x4[..., cols].masked_fill_(blocked, value)


def _keep(shape, dropout_p, seed, index, device, dtype):
    """The scaled dropout keep-mask of tile ``index``, regenerated identically in backward from ``(seed, index)``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed) * 1_000_003 + index)
    keep = torch.rand(shape, generator=gen, device=device) >= dropout_p
    return keep.to(dtype) / (1.0 - dropout_p)


# A capped call keeps the tanh of its first tiles, as many as fit this many logits, from forward for backward instead
# of recomputing the logits' matmul and the tanh there: 2**22 float32 = 16 MiB per call at most. Keeping part of a
# larger call's tiles beats recomputing all of them, and beats keeping all (benchmarks/results/tuning.md, Measured on
# CPU).
KEEP_TANH_MAX = 1 << 22

# exp(+-c) must stay a normal float and the row sums (up to kv_len * e^c) finite for the softmax to skip its max shift
_NO_SHIFT_LIMIT = {torch.float32: 80.0, torch.float64: 700.0}


class _Call:
    """The fixed facts of one call, shared by forward and backward."""

    def __init__(
        self, q, k, mask, scaling, softcap, causal, sliding_window, dropout_p, seed, tile_elements=None, query_rows=None
    ):
        self.batch, self.heads, self.q_len, self.head_dim = q.shape
        self.kv_heads, self.kv_len = k.shape[1], k.shape[2]
        self.groups = self.heads // self.kv_heads
        self.n = self.batch * self.kv_heads
        self.mask, self.causal, self.window = mask, causal, sliding_window
        self.scaling, self.softcap, self.dropout_p, self.seed = scaling, softcap, dropout_p, seed
        self.acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        # Logits as the matmul leaves them: 2x = 2*s/c with a cap (tanh's argument, doubled for expm1), else s*log2(e)
        # (base 2). `gain` turns them into base-2 exponents: c*log2(e)*tanh(x), or the logit itself.
        self.prescale = 2.0 * scaling / softcap if softcap is not None else scaling * LOG2E
        self.gain = softcap * LOG2E if softcap is not None else 1.0
        # A capped logit lies in [-c, c]: for a moderate cap exp(logit) neither overflows nor leaves the normal range,
        # and the softmax needs no row maximum (exactly as precise: the exponent is rounded the same way).
        self.row_shift = softcap is None or softcap + math.log(max(2, self.kv_len)) > _NO_SHIFT_LIMIT[self.acc]
        if tile_elements is None:  # several threads: larger tiles, fewer parallel regions
            threads = 1 if torch.compiler.is_compiling() else max(1, torch.get_num_threads())
            tile_elements = _tiles.TILE_ELEMENTS * threads
        self.tiles = _tiles.plan(
            self.n,
            self.q_len,
            self.kv_len,
            self.groups,
            causal,
            sliding_window,
            tile_elements=tile_elements,
            query_rows=query_rows,
        )
        self.tile_max = (
            max((t[1] - t[0]) * (t[3] - t[2]) * self.groups * (t[5] - t[4]) for t in self.tiles) if self.tiles else 0
        )
        # scratch for the products that land in strided outputs: (rows, queries, head_dim) and (rows, head_dim, keys)
        self.out_max = (
            max((t[1] - t[0]) * self.head_dim * max((t[3] - t[2]) * self.groups, t[5] - t[4]) for t in self.tiles)
            if self.tiles
            else 0
        )
        # where each tile's logits start in one flat buffer, and how many there are in all
        self.tile_offsets, total = [], 0
        for tile in self.tiles:
            n0, n1, start, end, lo, hi, _ = tile
            self.tile_offsets.append(total)
            total += (n1 - n0) * (end - start) * self.groups * (hi - lo)
        self.tile_total = total
        self.kept_tiles = 0  # how many of the first tiles keep their tanh for backward (set by forward)
        self.clamp = True
        self.native = None  # the native tile passes, where this call takes them (set by forward: use_native)
        self._edges: dict = {}
        self.sink = None  # (batch * kv_heads, 1, groups): the sink logits in base 2, set by TiledAttention

    def set_sink(self, sink: torch.Tensor | None) -> None:
        """Per-head sink logits ``(heads,)`` (``s_aux``), packed to broadcast against a tile's rows viewed as
        ``(rows, queries, groups)``, in the base-2 domain of the exponents. A sink forces the row shift."""
        if sink is None:
            return
        self.row_shift = True
        packed = (sink.detach().to(self.acc) * LOG2E).view(1, self.kv_heads, 1, self.groups)
        self.sink = packed.expand(self.batch, -1, -1, -1).reshape(self.n, 1, self.groups)

    def use_native(self, qp: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor) -> None:
        """Take the native elementwise passes (:mod:`.native`) where this call is theirs: a cap whose exponents need
        no row shift, no dropout, and the packed operands and the largest tile as :func:`.native.eligible` allows."""
        if (
            self.softcap is not None
            and not self.row_shift
            and self.dropout_p == 0
            and native.eligible(qp, kp, vp, self.tile_max)
        ):
            self.native = NATIVE[0]

    def check_clamp(self, qp: torch.Tensor, kp: torch.Tensor) -> None:
        """Whether tanh's argument may pass the clamp: |2x| <= |qp| |kp| (Cauchy-Schwarz), checked once per call."""
        if self.softcap is None or torch.compiler.is_compiling() or not self.tiles:
            return
        bound = torch.linalg.vector_norm(qp, dim=-1).max() * torch.linalg.vector_norm(kp, dim=-1).max()
        self.clamp = not bool(bound <= TANH_CLAMP)  # NaN or inf inputs: clamp

    def band(self, tile) -> tuple[int, int, int, int, int]:
        """The causal/window pattern of ``tile`` as the native passes take it: row ``i`` of a block (query ``i //
        groups`` of the tile) sees columns ``[lo0 + lo_step * qi, hi0 + hi_step * qi)`` -> ``(lo0, lo_step, hi0,
        hi_step, groups)``; the same pairs :func:`~.tiles.position_mask` allows."""
        n0, n1, start, end, lo, hi, _ = tile
        shift = self.kv_len - self.q_len  # query r sits at key position r + shift (bottom-right aligned)
        lo0, lo_step = (0, 0) if self.window is None else (start + shift - self.window + 1 - lo, 1)
        hi0, hi_step = (start + shift + 1 - lo, 1) if self.causal else (hi - lo, 0)
        return lo0, lo_step, hi0, hi_step, self.groups

    def user_masks(self, tile) -> list:
        """The caller's mask's part of :meth:`masks` (what the native passes' band leaves to the caller)."""
        if self.mask is None:
            return []
        return [(slice(None), ~user_mask_tile(self.mask, tile, self.kv_heads, self.groups))]

    def masks(self, tile, device) -> list:
        """``(column slice, blocked)`` pairs for ``tile``, each ``blocked`` (True = hidden) broadcastable to the tile
        viewed as ``(rows, queries, groups, keys)``: the causal/window edges (the same for every row range of a query
        block, so made once), then the caller's mask."""
        n0, n1, start, end, lo, hi, edges = tile
        key = (start, end, lo)
        if key not in self._edges:
            self._edges[key] = [
                (
                    slice(c0 - lo, c1 - lo),
                    ~position_mask(start, end, c0, c1, self.q_len, self.kv_len, self.causal, self.window, device)[
                        :, None
                    ],
                )
                for c0, c1 in edges
            ]
        return self._edges[key] + self.user_masks(tile)

    def uncovered_rows(self):
        """Packed query rows no tile covers (they attend to nothing), as slices."""
        covered = sorted({(t[2], t[3]) for t in self.tiles})
        edge, gaps = 0, []
        for start, end in covered + [(self.q_len, self.q_len)]:
            if start > edge:
                gaps.append(slice(edge * self.groups, start * self.groups))
            edge = max(edge, end)
        return gaps

    def pack(self, x: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """``(batch, heads, q_len, d)`` -> ``(batch * kv_heads, q_len * groups, d)`` in the accumulation dtype."""
        out = torch.empty(
            (self.batch, self.kv_heads, self.q_len, self.groups, self.head_dim), dtype=self.acc, device=x.device
        )
        out.copy_(x.unflatten(1, (self.kv_heads, self.groups)).transpose(2, 3))
        if scale is not None:
            out.mul_(scale)
        return out.view(self.n, self.q_len * self.groups, self.head_dim)

    def unpack(self, x: torch.Tensor, dtype) -> torch.Tensor:
        """The inverse of :meth:`pack` as a ``(batch, q_len, heads, d)`` tensor of ``dtype``."""
        out = torch.empty((self.batch, self.q_len, self.heads, self.head_dim), dtype=dtype, device=x.device)
        out.view(self.batch, self.q_len, self.kv_heads, self.groups, self.head_dim).copy_(
            x.view(self.batch, self.kv_heads, self.q_len, self.groups, self.head_dim).transpose(1, 2)
        )
        return out


def _kept_tiles(c: _Call) -> tuple[int, int]:
    """How many of the call's first tiles keep their tanh -- as many as fit ``KEEP_TANH_MAX`` logits in all -- and
    how many logits they hold (each tile ends where the next starts, the last at ``tile_total``)."""
    ends = c.tile_offsets[1:] + [c.tile_total] if c.tiles else []
    count = sum(1 for end in ends if end <= KEEP_TANH_MAX)  # ends rise: the first ``count`` tiles (not bisect: Dynamo)
    return count, ends[count - 1] if count else 0


def _kept(c: _Call, i: int, kept: torch.Tensor, shape) -> torch.Tensor:
    """Tile ``i``'s part of the flat buffer of kept tanh values, shaped like its logits."""
    return kept[c.tile_offsets[i] : c.tile_offsets[i] + math.prod(shape)].view(shape)


def _forward_tile(c: _Call, i: int, tile, qp, kp, vp, out, lse, head_max, bufs, kept=None) -> None:
    n0, n1, start, end, lo, hi, _ = tile
    rows, shape = slice(start * c.groups, end * c.groups), (n1 - n0, (end - start) * c.groups, hi - lo)
    s = torch.bmm(qp[n0:n1, rows], kp[n0:n1, lo:hi].transpose(1, 2), out=_scratch(bufs[0], shape))
    masks = None
    shift = None
    if c.row_shift or head_max is not None:
        masks = c.masks(tile, s.device)
        _fill(s, masks, c.groups, float("-inf"))
        top = s.amax(-1, keepdim=True)  # the largest allowed (scaled) pre-cap logit of each row
        if head_max is not None:
            head_max[n0:n1] = torch.maximum(head_max[n0:n1], top.view(n1 - n0, end - start, c.groups).amax(1))
        if c.row_shift:  # a row with no allowed key: tanh(-inf) = -1, or 0 without a cap
            shift = (
                tanh_doubled_(top.clone(), torch.empty_like(top), True).mul_(c.gain)
                if c.softcap is not None
                else torch.where(torch.isfinite(top), top, 0.0)
            )
            if c.sink is not None:  # the sink's exponent is shifted too, so it cannot overflow
                shift = torch.maximum(shift.view(n1 - n0, end - start, c.groups), c.sink[n0:n1]).view(shift.shape)
    if c.native is not None:  # one pass: tanh, the exponent, its row sums (and the kept tanh); no shift here
        norm = torch.empty((*shape[:2], 1), dtype=s.dtype)
        kept_tile = _kept(c, i, kept, shape) if kept is not None else None
        native.forward_tile(c.native, s, kept_tile, norm, c.gain, c.band(tile))  # outside the band: p = 0, not summed
        p = s
        user = c.user_masks(tile)
        if user:  # the caller's masked pairs hold a finite exponent: zeroed, and the sums taken again without them
            _fill(p, user, c.groups, 0.0)
            norm = p.sum(-1, keepdim=True)
        _finish_forward_tile(c, tile, p, norm, None, vp, out, lse, bufs)
        return
    if masks is None:
        masks = c.masks(tile, s.device)
    base = torch.zeros((), dtype=s.dtype, device=s.device) if shift is None else shift.neg_()
    if c.softcap is None:
        p = torch.add(base, s, alpha=c.gain, out=s).exp2_()
    else:  # the exponent c*log2(e)*tanh(x) - shift in one pass: gain * e / (e + 2) + base
        e, e2 = expm1_doubled_(s, _scratch(bufs[1], shape), c.clamp)
        if kept is not None:  # tanh kept for backward: exactly what its recomputation would give
            torch.div(e, e2, out=_kept(c, i, kept, shape))
        p = torch.addcdiv(base, e, e2, value=c.gain, out=e).exp2_()  # the same bits whether kept or not
    if c.softcap is not None:  # masked pairs still hold a finite exponent (tanh(-inf) = -1, or never filled)
        _fill(p, masks, c.groups, 0.0)
    norm = p.sum(-1, keepdim=True)
    if c.sink is not None:  # the sink joins the denominator only: a logit that attends to nothing
        sink_rows = (n1 - n0, end - start, c.groups)
        norm.view(sink_rows).add_(torch.add(base.view(sink_rows), c.sink[n0:n1]).exp2_())
    dropout_index = i if c.dropout_p > 0 else None
    _finish_forward_tile(c, tile, p, norm, None if shift is None else base, vp, out, lse, bufs, dropout_index)


def _finish_forward_tile(c: _Call, tile, p, norm, base, vp, out, lse, bufs, dropout_index=None) -> None:
    """The tile's row log-sum-exp (``base``: the rows' exponent shift, or None) and its share of the output:
    ``p v / sum(p)`` (``dropout_index``: the tile whose keep-mask multiplies ``p``)."""
    n0, n1, start, end, lo, hi, _ = tile
    rows = slice(start * c.groups, end * c.groups)
    row_lse = norm.log2() if base is None else norm.log2().sub_(base)
    lse[n0:n1, rows] = row_lse.masked_fill_(norm == 0, float("inf"))
    if dropout_index is not None:
        p.mul_(_keep(p.shape, c.dropout_p, c.seed, dropout_index, p.device, p.dtype))
    o = _matmul_into(out[n0:n1, rows], p, vp[n0:n1, lo:hi], bufs[2], False)
    o.div_(norm.clamp_min(torch.finfo(norm.dtype).tiny))  # a row with no allowed key: 0 / tiny = 0


def _backward_tile(c: _Call, i: int, tile, qp, kp, vp, do, neg_lse, delta, grads, bufs, kept=None) -> None:
    n0, n1, start, end, lo, hi, _ = tile
    dq, dkt, dvt = grads
    rows, shape = slice(start * c.groups, end * c.groups), (n1 - n0, (end - start) * c.groups, hi - lo)
    qt, dot, kt, vt = qp[n0:n1, rows], do[n0:n1, rows], kp[n0:n1, lo:hi], vp[n0:n1, lo:hi]
    if c.native is not None:
        _backward_tile_native(c, i, tile, qt, dot, kt, vt, neg_lse, delta, grads, bufs, kept)
        return
    if kept is not None:  # forward's tanh: no matmul, no tanh here
        t, p_out = _kept(c, i, kept, shape), _scratch(bufs[0], shape)
    else:
        t = p_out = torch.bmm(qt, kt.transpose(1, 2), out=_scratch(bufs[0], shape))
        if c.softcap is not None:
            t = p_out = tanh_doubled_(t, _scratch(bufs[1], shape), c.clamp)
    slope = None
    if c.softcap is not None:
        slope = torch.addcmul(bufs[3], t, t, value=-1.0, out=_scratch(bufs[2], shape))  # d c*tanh(s/c) / ds
    p = torch.add(neg_lse[n0:n1, rows], t, alpha=c.gain, out=p_out).exp2_()  # lse = +inf on empty rows: p = 0
    _fill(p, c.masks(tile, p.device), c.groups, 0.0)
    keep = _keep(shape, c.dropout_p, c.seed, i, p.device, p.dtype) if c.dropout_p > 0 else None
    _matmul_into(dvt[n0:n1, :, lo:hi], dot.transpose(1, 2), p if keep is None else p * keep, bufs[4], True)
    dp = torch.bmm(dot, vt.transpose(1, 2), out=_scratch(bufs[1], shape))
    if keep is not None:
        dp.mul_(keep)
    ds = dp.sub_(delta[n0:n1, rows]).mul_(p)  # dL/d(capped logit); delta = rowsum(dO o O), dropout included
    if slope is not None:
        ds.mul_(slope)
    _matmul_into(dq[n0:n1, rows], ds, kt, bufs[4], False)
    _matmul_into(dkt[n0:n1, :, lo:hi], qt.transpose(1, 2), ds, bufs[4], True)


def _backward_tile_native(c: _Call, i: int, tile, qt, dot, kt, vt, neg_lse, delta, grads, bufs, kept) -> None:
    """:func:`_backward_tile` with the native passes (capped, float32, no dropout): the probabilities and the cap's
    slope in one pass, the logit gradients in another."""
    n0, n1, start, end, lo, hi, _ = tile
    dq, dkt, dvt = grads
    rows, shape = slice(start * c.groups, end * c.groups), (n1 - n0, (end - start) * c.groups, hi - lo)
    if kept is not None:  # forward's tanh: no matmul, no tanh here
        src, recompute, p = _kept(c, i, kept, shape), False, _scratch(bufs[0], shape)
    else:
        src = p = torch.bmm(qt, kt.transpose(1, 2), out=_scratch(bufs[0], shape))
        recompute = True
    slope = _scratch(bufs[2], shape)
    row_lse, row_delta = neg_lse[n0:n1, rows], delta[n0:n1, rows]  # (rows, queries, 1), strided over rows
    native.backward_p(c.native, src, recompute, row_lse, p, slope, c.gain, c.band(tile))  # 0 outside the band
    _fill(p, c.user_masks(tile), c.groups, 0.0)
    _matmul_into(dvt[n0:n1, :, lo:hi], dot.transpose(1, 2), p, bufs[4], True)
    dp = torch.bmm(dot, vt.transpose(1, 2), out=_scratch(bufs[1], shape))
    native.backward_ds(c.native, dp, p, slope, row_delta)
    _matmul_into(dq[n0:n1, rows], dp, kt, bufs[4], False)
    _matmul_into(dkt[n0:n1, :, lo:hi], qt.transpose(1, 2), dp, bufs[4], True)


class TiledAttention(torch.autograd.Function):
    """``softmax(mask(c*tanh(scaling * q k^T / c))) v`` (no cap: ``softcap=None``) over cache-sized tiles, with
    recomputation in backward. ``q`` ``(B, H, Tq, D)``; ``k``, ``v`` ``(B, Hkv, Tk, D)`` with ``H % Hkv == 0`` (GQA
    without copying K/V); ``mask`` boolean broadcastable to ``(B, H, Tq, Tk)`` or ``None``; causality and the window
    bottom-right aligned. Accumulates in float32 for half-precision inputs (float64 stays float64); rows with no
    allowed key give zeros. Returns the output ``(B, H, Tq, D)`` (a view of a ``(B, Tq, H, D)`` tensor) and, when
    ``return_max_logits``, the largest pre-cap logit ``scaling * q.k`` of each query head over the batch and the
    allowed pairs, ``(H,)`` in the accumulation dtype (``-inf`` for a head with no allowed pair; no gradient)."""

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        mask,
        scaling,
        softcap,
        causal,
        sliding_window,
        dropout_p,
        seed,
        return_max_logits,
        sink=None,
        grad=True,
    ):
        c = _Call(q, k, mask, scaling, softcap, causal, sliding_window, dropout_p, seed)
        c.set_sink(sink)
        qp = c.pack(q, c.prescale)
        kp = k.to(c.acc).reshape(c.n, c.kv_len, c.head_dim)
        vp = v.to(c.acc).reshape(c.n, c.kv_len, c.head_dim)
        c.use_native(qp, kp, vp)
        c.check_clamp(qp, kp)
        out = torch.empty_like(qp)
        for rows in c.uncovered_rows():
            out[:, rows] = 0.0
        lse = torch.full((*qp.shape[:2], 1), float("inf"), dtype=c.acc, device=q.device)
        head_max = (
            torch.full((c.n, c.groups), float("-inf"), dtype=c.acc, device=q.device) if return_max_logits else None
        )
        bufs = [torch.empty(n, dtype=c.acc, device=q.device) for n in (c.tile_max, c.tile_max, c.out_max)]
        # the first tiles whose logits fit KEEP_TANH_MAX keep their tanh for backward (all of them in a small call);
        # ``grad``: whether the caller records a graph (inside forward, grad mode is always off)
        c.kept_tiles, kept_len = (
            _kept_tiles(c) if softcap is not None and grad and any(ctx.needs_input_grad[:3]) else (0, 0)
        )
        kept = torch.empty(kept_len, dtype=c.acc, device=q.device) if c.kept_tiles else None
        for i, tile in enumerate(c.tiles):
            _forward_tile(c, i, tile, qp, kp, vp, out, lse, head_max, bufs, kept if i < c.kept_tiles else None)
        ctx.save_for_backward(qp, kp, vp, out, lse, *(() if kept is None else (kept,)))
        ctx.call, ctx.dtypes = c, (q.dtype, k.dtype, v.dtype)
        ctx.sink_dtype = None if sink is None else sink.dtype
        result = c.unpack(out, q.dtype).transpose(1, 2)
        if not return_max_logits:
            return result
        # back to pre-cap logits s: the tiles hold 2x = 2s/c with a cap, s*log2(e) without
        head_max = head_max.view(c.batch, c.heads).amax(0).mul_(softcap / 2 if softcap is not None else 1 / LOG2E)
        ctx.mark_non_differentiable(head_max)
        return result, head_max

    @staticmethod
    def backward(ctx, dout, *_):
        qp, kp, vp, out, lse, *kept = ctx.saved_tensors
        kept = kept[0] if kept else None
        c = ctx.call
        do = c.pack(dout)
        delta = (do * out).sum(-1, keepdim=True)
        dq = torch.empty_like(qp)
        for rows in c.uncovered_rows():
            dq[:, rows] = 0.0
        dkt = torch.zeros((c.n, c.head_dim, c.kv_len), dtype=c.acc, device=qp.device)
        dvt = torch.zeros_like(dkt)
        bufs = [torch.empty(c.tile_max, dtype=c.acc, device=qp.device) for _ in range(3)]
        bufs += [torch.ones((), dtype=c.acc, device=qp.device), torch.empty(c.out_max, dtype=c.acc, device=qp.device)]
        neg_lse = lse.neg()
        for i, tile in enumerate(c.tiles):
            _backward_tile(
                c, i, tile, qp, kp, vp, do, neg_lse, delta, (dq, dkt, dvt), bufs, kept if i < c.kept_tiles else None
            )
        # qp carries the prescale: dq = scaling * dS k, dk = scaling * dS^T q = (scaling / prescale) * dS^T qp
        dq = c.unpack(dq.mul_(c.scaling), ctx.dtypes[0]).transpose(1, 2)
        kv_shape = (c.batch, c.kv_heads, c.kv_len, c.head_dim)
        dk = dkt.transpose(1, 2).mul_(c.scaling / c.prescale).reshape(kv_shape).to(ctx.dtypes[1])
        dv = dvt.transpose(1, 2).reshape(kv_shape).to(ctx.dtypes[2])
        dsink = None
        if c.sink is not None and ctx.needs_input_grad[11]:
            # d/d(sink) = -p_sink * rowsum(dO o O), p_sink = exp(sink - lse) (0 on rows no tile covers: lse = inf)
            rows = (c.n, c.q_len, c.groups)
            p_sink = torch.sub(c.sink, lse.view(rows)).exp2_()
            dsink = p_sink.mul_(delta.view(rows)).sum(1).neg_().view(c.batch, c.heads).sum(0).to(ctx.sink_dtype)
        return dq, dk, dv, None, None, None, None, None, None, None, None, dsink, None


def chunked_attention(
    q,
    k,
    v,
    *,
    scaling,
    softcap=None,
    mask=None,
    causal=True,
    sliding_window=None,
    dropout_p=0.0,
    return_max_logits=False,
    sink=None,
):
    """Attention with an optional cap whose memory grows linearly with sequence length.

    ``q`` ``(B, H, Tq, D)``; ``k``, ``v`` ``(B, Hkv, Tk, D)``; ``mask`` boolean (True = attend) broadcastable to
    ``(B, H, Tq, Tk)``, intersected with ``causal`` and ``sliding_window`` (bottom-right aligned). ``sink``: ``(H,)``
    per-head sink logits (``s_aux``, gpt-oss) that join each row's softmax denominator, uncapped and unscaled, and
    attend to nothing; differentiable. Returns ``(B, H, Tq, D)``, and with ``return_max_logits`` also the per-head
    largest pre-cap logit ``(H,)`` (see :class:`TiledAttention`; the sink is not a logit of any pair)."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item()) if dropout_p > 0 else 0
    return TiledAttention.apply(
        q,
        k,
        v,
        mask,
        float(scaling),
        None if softcap is None else float(softcap),
        bool(causal),
        sliding_window,
        float(dropout_p),
        seed,
        bool(return_max_logits),
        sink,
        torch.is_grad_enabled(),
    )


# The max-only pass does one matmul and two light passes per tile: smaller query blocks than the attention's waste
# less of the causal diagonal block, at no cost in per-tile work worth saving.
MAX_QUERY_ROWS = 32


@torch.no_grad()
def max_logits(q, k, *, scaling, mask=None, causal=True, sliding_window=None, tile_elements=None) -> torch.Tensor:
    """The largest logit ``scaling * q.k`` of each query head over the batch and the allowed pairs, without the
    attention: the telemetry of backends that do not produce it themselves. The tiling, masks and GQA packing of
    :class:`TiledAttention`: one matmul per tile, keys past a causal diagonal skipped, a mask only on edge columns.

    ``q`` ``(B, H, Tq, D)``, ``k`` ``(B, Hkv, Tk, D)``, ``mask`` as for :func:`chunked_attention`. Returns ``(H,)``
    in float32 (float64 for float64 inputs), ``-inf`` for a head with no allowed pair."""
    c = _Call(
        q,
        k,
        mask,
        scaling,
        None,
        causal,
        sliding_window,
        0.0,
        0,
        tile_elements=tile_elements,
        query_rows=MAX_QUERY_ROWS,
    )
    # max(scaling * x) = scaling * max(x) for scaling >= 0: then contiguous MHA inputs are used as they are
    post = scaling > 0 and c.groups == 1 and q.dtype == c.acc and q.is_contiguous()
    qp = q.view(c.n, c.q_len, c.head_dim) if post else c.pack(q, scaling)
    kp = k.to(c.acc).reshape(c.n, c.kv_len, c.head_dim)
    best = torch.full((c.n, c.groups), float("-inf"), dtype=c.acc, device=q.device)
    buf = torch.empty(c.tile_max, dtype=c.acc, device=q.device)
    for tile in c.tiles:
        n0, n1, start, end, lo, hi, _ = tile
        rows, shape = slice(start * c.groups, end * c.groups), (n1 - n0, (end - start) * c.groups, hi - lo)
        s = torch.bmm(qp[n0:n1, rows], kp[n0:n1, lo:hi].transpose(1, 2), out=_scratch(buf, shape))
        _fill(s, c.masks(tile, s.device), c.groups, float("-inf"))
        best[n0:n1] = torch.maximum(best[n0:n1], s.amax(-1).view(n1 - n0, end - start, c.groups).amax(1))
    best = best.view(c.batch, c.heads).amax(0)
    return best.mul_(scaling) if post else best

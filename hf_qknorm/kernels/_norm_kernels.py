"""Triton kernels for the per-head norms of :mod:`hf_qknorm.portable.norms`, forward and backward.

Rows are ``(n_rows, head_dim)`` (one head of one token per row). A program works on a tile of ``BLOCK_R`` rows at
once (the row statistics reduce along the tile's second axis), so a short head (64 or 128 channels) still fills a
program's threads. The forward runs one tile per program. The backward runs a fixed number of programs, each
looping over the tiles ``pid, pid + programs, ...`` and summing its rows' share of the gain/bias/scale gradients in
registers; it writes one partial row per program, summed on the host (deterministic: the split depends only on the
shape and the program count).
``KIND``: 0 layernorm (gain and bias), 1 rmsnorm (gain; ``Qwen3RMSNorm``'s arithmetic: the normalised row rounded to
the input dtype before the gain), 2 lp (``x / max(||x||_p, eps)`` scaled by ``max|x|`` first, times no scale, a
scalar logit scale or a per-channel scale). ``OFFSET`` is added to the gain (``1 + w`` gains). Statistics are
float32; the forward saves ``mean`` (layernorm; ``max|x|`` for lp) and ``rstd`` (``1/rms``; ``||x/max|x|||_p`` for lp).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import to_dtype


@triton.jit
def _abs_pow(a, P: tl.constexpr, p):
    """``|a|**p`` for ``a`` in [0, 1]; ``P`` 2 selects the square. Every float literal in these kernels is a normal
    float32 (1.1754943508222875e-38 is float32's smallest): Triton types a smaller one as float64, and Triton 3.6 then
    computes in float64 and refuses the kernel (tests/kernels/test_kernel_literals.py)."""
    if P == 2:
        return a * a
    return tl.where(a > 0, tl.exp2(p * tl.log2(tl.maximum(a, 1.1754943508222875e-38))), 0.0)


@triton.jit
def _gain(W, cols, cmask, OFFSET: tl.constexpr, W_SCALAR: tl.constexpr):
    """The gain as a float32 row (a scalar for a logit scale), ``OFFSET`` added."""
    if W_SCALAR:
        w = tl.load(W).to(tl.float32) + OFFSET
    else:
        w = (tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32) + OFFSET)[None, :]
    return w


@triton.jit
def _head_norm_fwd(
    X,
    W,
    B,
    Y,
    MEAN,
    RSTD,
    n_rows,
    D,
    eps,
    p,
    OFFSET: tl.constexpr,
    KIND: tl.constexpr,
    HAS_W: tl.constexpr,
    W_SCALAR: tl.constexpr,
    HAS_B: tl.constexpr,
    P: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program = the ``BLOCK_R`` rows of tile ``program_id(0)``. Grid: ``(cdiv(n_rows, BLOCK_R),)``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < n_rows
    cmask = cols < D
    ok = rmask[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
    if KIND == 0:
        mean = tl.sum(x, 1) / D
        xc = tl.where(ok, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 1) / D + eps)
        y = xc * rstd[:, None]
        if HAS_W:
            y = y * _gain(W, cols, cmask, OFFSET, W_SCALAR)
        if HAS_B:
            y = y + tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    elif KIND == 1:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)
        y = to_dtype(x * rstd[:, None], X.dtype.element_ty).to(tl.float32)
        if HAS_W:
            y = _gain(W, cols, cmask, OFFSET, W_SCALAR) * y
    else:
        mean = tl.maximum(tl.max(tl.abs(x), 1), 1.1754943508222875e-38)  # max|x|, at least float32's tiny
        u = x / mean[:, None]
        s = tl.sum(_abs_pow(tl.abs(u), P, p), 1)
        if P == 2:
            rstd = tl.sqrt(s)
        else:
            rstd = tl.where(s > 0, tl.exp2(tl.log2(tl.maximum(s, 1.1754943508222875e-38)) / p), 0.0)
        y = u / tl.maximum(rstd, eps / mean)[:, None]
        if HAS_W:
            y = y * _gain(W, cols, cmask, OFFSET, W_SCALAR)
    tl.store(Y + offs, to_dtype(y, Y.dtype.element_ty), mask=ok)
    if KIND != 1:
        tl.store(MEAN + rows, mean, mask=rmask)
    tl.store(RSTD + rows, rstd, mask=rmask)


@triton.jit
def _head_norm_bwd(
    X,
    W,
    GY,
    GX,
    GW,
    GB,
    MEAN,
    RSTD,
    n_rows,
    D,
    eps,
    p,
    OFFSET: tl.constexpr,
    KIND: tl.constexpr,
    HAS_W: tl.constexpr,
    W_SCALAR: tl.constexpr,
    HAS_B: tl.constexpr,
    P: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program = the tiles ``program_id(0) + k * num_programs(0)``; its partial gain (bias) gradient goes to row
    ``program_id(0)`` of ``GW`` (``GB``). Grid: ``(programs,)``, any count."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    if HAS_W:
        w = _gain(W, cols, cmask, OFFSET, W_SCALAR)
    gw = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    gb = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    for tile in range(pid, tl.cdiv(n_rows, BLOCK_R), tl.num_programs(0)):
        rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < n_rows
        ok = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
        gy = tl.load(GY + offs, mask=ok, other=0.0).to(tl.float32)
        # Rows past the end read mean 1 and rstd 1: every product below stays finite there (their gy is 0).
        if KIND != 1:
            mean = tl.load(MEAN + rows, mask=rmask, other=1.0)
        rstd = tl.load(RSTD + rows, mask=rmask, other=1.0)
        g = gy
        if HAS_W:
            g = gy * w
        if KIND == 0:
            xhat = tl.where(ok, (x - mean[:, None]) * rstd[:, None], 0.0)
            gx = rstd[:, None] * (g - tl.sum(g, 1)[:, None] / D - xhat * (tl.sum(g * xhat, 1) / D)[:, None])
            gw += gy * xhat
            gb += gy
        elif KIND == 1:
            xhat = x * rstd[:, None]
            gx = rstd[:, None] * (g - xhat * (tl.sum(g * xhat, 1) / D)[:, None])
            gw += gy * to_dtype(xhat, X.dtype.element_ty).to(tl.float32)
        else:
            u = x / mean[:, None]
            den = tl.maximum(rstd, eps / mean)
            # d||u||_p/du = sign(u) |u|^(p-1) / n^(p-1); rows whose norm is below eps take g / eps, and read 1 for
            # the norm and its scale in the branch they do not take, so that it stays finite
            big = rstd * mean > eps
            safe = tl.where(big, rstd, 1.0)
            if P == 2:
                s = u / safe[:, None]
            else:
                a = tl.abs(u)
                s = tl.where(u < 0, -1.0, 1.0) * tl.where(
                    a > 0,
                    tl.exp2((p - 1.0) * (tl.log2(tl.maximum(a, 1.1754943508222875e-38)) - tl.log2(safe)[:, None])),
                    0.0,
                )
            gx_norm = (g - (tl.sum(g * u, 1) / safe)[:, None] * s) / tl.where(big, mean * rstd, 1.0)[:, None]
            gx = tl.where(big[:, None], gx_norm, g / eps)
            yhat = u / den[:, None]
            if W_SCALAR:
                gw += tl.where(cols[None, :] == 0, tl.sum(gy * yhat, 1)[:, None], 0.0)
            else:
                gw += gy * yhat
        tl.store(GX + offs, to_dtype(gx, GX.dtype.element_ty), mask=ok)
    if HAS_W:
        tl.store(GW + pid * BLOCK_D + cols, tl.sum(gw, 0))
    if HAS_B:
        tl.store(GB + pid * BLOCK_D + cols, tl.sum(gb, 0))

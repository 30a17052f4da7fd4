"""Triton kernels for the per-head norms of :mod:`hf_qknorm.portable.norms`, forward and backward.

One program normalises ``ROWS`` rows of ``(n_rows, head_dim)`` (one head of one token per row) and, in the backward,
accumulates its rows' share of the gain/bias/scale gradients into one partial row, summed on the host.
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
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    if HAS_W:
        if W_SCALAR:
            w = tl.load(W).to(tl.float32) + OFFSET
        else:
            w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32) + OFFSET
    if HAS_B:
        b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        if row < n_rows:
            x = tl.load(X + row * D + cols, mask=cmask, other=0.0).to(tl.float32)
            if KIND == 0:
                mean = tl.sum(x, 0) / D
                xc = tl.where(cmask, x - mean, 0.0)
                rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 0) / D + eps)
                y = xc * rstd
                if HAS_W:
                    y = y * w
                if HAS_B:
                    y = y + b
            elif KIND == 1:
                rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
                h = to_dtype(x * rstd, X.dtype.element_ty).to(tl.float32)
                y = h
                if HAS_W:
                    y = w * h
            else:
                mean = tl.maximum(tl.max(tl.abs(x), 0), 1.1754943508222875e-38)  # max|x|, at least float32's tiny
                u = x / mean
                s = tl.sum(_abs_pow(tl.abs(u), P, p), 0)
                if P == 2:
                    rstd = tl.sqrt(s)
                else:
                    rstd = tl.where(s > 0, tl.exp2(tl.log2(tl.maximum(s, 1.1754943508222875e-38)) / p), 0.0)
                y = u / tl.maximum(rstd, eps / mean)
                if HAS_W:
                    y = y * w
            tl.store(Y + row * D + cols, to_dtype(y, Y.dtype.element_ty), mask=cmask)
            if KIND != 1:
                tl.store(MEAN + row, mean)
            tl.store(RSTD + row, rstd)


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
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    if HAS_W:
        if W_SCALAR:
            w = tl.load(W).to(tl.float32) + OFFSET
        else:
            w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32) + OFFSET
    gw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    gb = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        if row < n_rows:
            x = tl.load(X + row * D + cols, mask=cmask, other=0.0).to(tl.float32)
            gy = tl.load(GY + row * D + cols, mask=cmask, other=0.0).to(tl.float32)
            if KIND != 1:
                mean = tl.load(MEAN + row)
            rstd = tl.load(RSTD + row)
            g = gy
            if HAS_W:
                g = gy * w
            if KIND == 0:
                xhat = tl.where(cmask, (x - mean) * rstd, 0.0)
                gx = rstd * (g - tl.sum(g, 0) / D - xhat * (tl.sum(g * xhat, 0) / D))
                gw += gy * xhat
                gb += gy
            elif KIND == 1:
                xhat = x * rstd
                gx = rstd * (g - xhat * (tl.sum(g * xhat, 0) / D))
                gw += gy * to_dtype(xhat, X.dtype.element_ty).to(tl.float32)
            else:
                u = x / mean
                den = tl.maximum(rstd, eps / mean)
                if rstd * mean > eps:
                    # d||u||_p/du = sign(u) |u|^(p-1) / n^(p-1)
                    if P == 2:
                        s = u / rstd
                    else:
                        a = tl.abs(u)
                        s = tl.where(u < 0, -1.0, 1.0) * tl.where(
                            a > 0,
                            tl.exp2((p - 1.0) * (tl.log2(tl.maximum(a, 1.1754943508222875e-38)) - tl.log2(rstd))),
                            0.0,
                        )
                    gx = (g - (tl.sum(g * u, 0) / rstd) * s) / (mean * rstd)
                else:
                    gx = g / eps
                yhat = u / den
                if W_SCALAR:
                    gw += tl.where(cols == 0, tl.sum(gy * yhat, 0), 0.0)
                else:
                    gw += gy * yhat
            tl.store(GX + row * D + cols, to_dtype(gx, GX.dtype.element_ty), mask=cmask)
    if HAS_W:
        tl.store(GW + pid * BLOCK_D + cols, gw)
    if HAS_B:
        tl.store(GB + pid * BLOCK_D + cols, gb)

"""Triton kernels for the fused per-head norm + RoPE (forward and backward).

One program handles ``BLOCK_R`` rows; a row is one (batch, position, head) vector of ``head_dim`` values, so the
norm's statistics never leave registers. RoPE is Llama's half-split layout, ``y * cos + rotate_half(y) * sin``:
the partner of column ``j`` is ``j +- head_dim/2``, which the kernel simply loads a second time (from cache) rather
than permuting registers -- Triton has no cheap in-register gather. The norm sits before RoPE, as in Qwen3.

``KIND``: 0 = layernorm ((x - mean) * rsqrt(var + eps) * w + b), 1 = rmsnorm (Qwen3RMSNorm arithmetic: fp32
``x * rsqrt(mean(x^2) + eps)``, rounded to the input dtype, times w), 2 = lp (``x / max(||x||_p, eps) * w``, where
w is absent, one scalar, or per channel). All arithmetic is fp32; the output is rounded once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import to_dtype


@triton.jit
def _row_offsets(rows, T, H, stride_b, stride_t, stride_h):
    """Element offset of row ``rows`` = (b, t, h) flattened in (B, T, H) order, for a tensor with these strides."""
    h = rows % H
    bt = rows // H
    return (bt // T) * stride_b + (bt % T) * stride_t + h * stride_h


@triton.jit
def _log2_pos(x):
    # log2 of a value >= 0, clamped away from 0 so that no -inf (and no interpreter warning) is produced;
    # 1e-30 is far below anything that survives the later exp2.
    return tl.math.log2(tl.maximum(x, 1e-30))


@triton.jit
def _pow_abs(x, e):
    """|x|^e for e > 0 as exp2(e * log2|x|), with 0 -> 0 (so padded columns add nothing to a norm)."""
    ax = tl.abs(x)
    return tl.where(ax > 0, tl.math.exp2(e * _log2_pos(ax)), 0.0)


@triton.jit
def _stats(x, d_ok, eps, p, D: tl.constexpr, KIND: tl.constexpr, IS_L2: tl.constexpr):
    """Per-row (center, inv, norm): the normalised row is ``(x - center) * inv``; ``norm`` is the lp norm."""
    if KIND == 0:
        mu = tl.sum(x, 1) / D
        xc = tl.where(d_ok[None, :], x - mu[:, None], 0.0)
        inv = 1.0 / tl.sqrt(tl.sum(xc * xc, 1) / D + eps)
        return mu, inv, inv
    elif KIND == 1:
        inv = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)
        return tl.zeros_like(inv), inv, inv
    else:
        if IS_L2:
            norm = tl.sqrt(tl.sum(x * x, 1))
        else:
            # scale by max|x| first so that sum |x|^p neither overflows (large p) nor underflows
            amax = tl.max(tl.abs(x), 1)
            scaled = tl.sum(_pow_abs(x / tl.maximum(amax, 1e-30)[:, None], p), 1)
            norm = tl.where(amax > 0, amax * tl.math.exp2(_log2_pos(scaled) / p), 0.0)
        inv = 1.0 / tl.maximum(norm, eps)
        return tl.zeros_like(inv), inv, norm


@triton.jit
def _normalise(x, mu, inv, cols, d_ok, W, B, OUT_DTYPE: tl.constexpr, KIND: tl.constexpr, HAS_W: tl.constexpr,
               HAS_B: tl.constexpr, W_SCALAR: tl.constexpr):
    """Normalised and affine-transformed values of ``x`` (a tile whose columns are ``cols``), and the
    pre-affine ``x_hat`` that the weight multiplies (rounded for rmsnorm, as Qwen3 does)."""
    if KIND == 0:
        xhat = (x - mu[:, None]) * inv[:, None]
    else:
        xhat = x * inv[:, None]
    if KIND == 1:
        xhat = to_dtype(xhat, OUT_DTYPE).to(tl.float32)  # Qwen3RMSNorm: `self.weight * hidden_states.to(input_dtype)`
    y = xhat
    if HAS_W:
        if W_SCALAR:
            y = y * tl.load(W).to(tl.float32)
        else:
            y = y * tl.load(W + cols, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(B + cols, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    return y, xhat


@triton.jit
def _norm_rope_fwd_kernel(
    X, Y, W, B, COS, SIN,
    n_rows, T, H,
    stride_xb, stride_xt, stride_xh,
    stride_cb, stride_ct, stride_sb, stride_st,
    eps, p,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, KIND: tl.constexpr, HAS_W: tl.constexpr,
    HAS_B: tl.constexpr, W_SCALAR: tl.constexpr, HAS_ROPE: tl.constexpr, IS_L2: tl.constexpr,
):
    """X: (B, T, H, D) any strides with the last one 1; Y: (B, T, H, D) contiguous, X's dtype; COS/SIN:
    (B, T, D) (stride 0 on a broadcast batch). Grid: (cdiv(B*T*H, BLOCK_R),)."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    d_ok = cols < D
    ok = (rows < n_rows)[:, None] & d_ok[None, :]
    x_row = _row_offsets(rows, T, H, stride_xb, stride_xt, stride_xh)[:, None]
    x = tl.load(X + x_row + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    mu, inv, _norm = _stats(x, d_ok, eps, p, D, KIND, IS_L2)
    y, _xhat = _normalise(x, mu, inv, cols, d_ok, W, B, Y.dtype.element_ty, KIND, HAS_W, HAS_B, W_SCALAR)
    if HAS_ROPE:
        HALF: tl.constexpr = D // 2
        partner = tl.where(cols < HALF, cols + HALF, cols - HALF)
        xp = tl.load(X + x_row + partner[None, :], mask=ok, other=0.0).to(tl.float32)
        yp, _xhatp = _normalise(xp, mu, inv, partner, d_ok, W, B, Y.dtype.element_ty, KIND, HAS_W, HAS_B, W_SCALAR)
        bt = rows // H
        cos = tl.load(COS + ((bt // T) * stride_cb + (bt % T) * stride_ct)[:, None] + cols[None, :], mask=ok,
                      other=0.0).to(tl.float32)
        sin = tl.load(SIN + ((bt // T) * stride_sb + (bt % T) * stride_st)[:, None] + cols[None, :], mask=ok,
                      other=0.0).to(tl.float32)
        # rotate_half(y) = cat(-y[HALF:], y[:HALF])
        y = y * cos + tl.where(cols < HALF, -yp, yp) * sin
    tl.store(Y + rows[:, None] * D + cols[None, :], to_dtype(y, Y.dtype.element_ty), mask=ok)


@triton.jit
def _norm_rope_bwd_kernel(
    DY, X, W, COS, SIN, DX, DW_PART, DB_PART,
    n_rows, T, H, num_blocks,
    stride_xb, stride_xt, stride_xh,
    stride_cb, stride_ct, stride_sb, stride_st,
    eps, p,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, KIND: tl.constexpr, HAS_W: tl.constexpr,
    HAS_B: tl.constexpr, W_SCALAR: tl.constexpr, HAS_ROPE: tl.constexpr, IS_L2: tl.constexpr,
):
    """DY, DX: (B, T, H, D) contiguous. Each program walks row blocks ``pid, pid + nprog, ...`` and writes its
    partial weight/bias gradients to row ``pid`` of DW_PART/DB_PART ((nprog, D) fp32), summed on the host: one
    fixed reduction order, so the weight gradient is deterministic (no atomics). Grid: (nprog,)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    d_ok = cols < D
    dw_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_W:
        if W_SCALAR:
            w = tl.load(W).to(tl.float32)
        else:
            w = tl.load(W + cols, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    for blk in range(pid, num_blocks, tl.num_programs(0)):
        rows = (blk * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        ok = (rows < n_rows)[:, None] & d_ok[None, :]
        x = tl.load(X + _row_offsets(rows, T, H, stride_xb, stride_xt, stride_xh)[:, None] + cols[None, :],
                    mask=ok, other=0.0).to(tl.float32)
        g = tl.load(DY + rows[:, None] * D + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if HAS_ROPE:
            # d/dy of y*cos + rotate_half(y)*sin is g*cos - rotate_half(g*sin) (rotate_half^T = -rotate_half)
            HALF: tl.constexpr = D // 2
            partner = tl.where(cols < HALF, cols + HALF, cols - HALF)
            bt = rows // H
            c_row = ((bt // T) * stride_cb + (bt % T) * stride_ct)[:, None]
            s_row = ((bt // T) * stride_sb + (bt % T) * stride_st)[:, None]
            cos = tl.load(COS + c_row + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            gp = tl.load(DY + rows[:, None] * D + partner[None, :], mask=ok, other=0.0).to(tl.float32)
            sinp = tl.load(SIN + s_row + partner[None, :], mask=ok, other=0.0).to(tl.float32)
            g = g * cos + tl.where(cols < HALF, gp, -gp) * sinp
        mu, inv, norm = _stats(x, d_ok, eps, p, D, KIND, IS_L2)
        if KIND == 0:
            xhat = tl.where(d_ok[None, :], (x - mu[:, None]) * inv[:, None], 0.0)
        else:
            xhat = x * inv[:, None]
        if HAS_B:
            db_acc += tl.sum(g, 0)
        if HAS_W:
            if KIND == 1:  # the weight multiplied the rounded x_hat; the rounding's gradient is the identity
                dw_acc += tl.sum(g * to_dtype(xhat, DX.dtype.element_ty).to(tl.float32), 0)
            else:
                dw_acc += tl.sum(g * xhat, 0)
            g = g * w
        # g is now dL/d(x_hat); pull it back through the normalisation of each row.
        if KIND == 0:
            dx = inv[:, None] * (g - (tl.sum(g, 1) / D)[:, None] - xhat * (tl.sum(g * xhat, 1) / D)[:, None])
        elif KIND == 1:
            dx = inv[:, None] * (g - xhat * (tl.sum(g * xhat, 1) / D)[:, None])
        else:
            # x_hat = x / n (n > eps): dx = g/n - (g.x) * dn/dx / n^2 with dn/dx = sign(x) (|x| / n)^(p-1)
            gx = tl.sum(g * x, 1)[:, None]
            n = tl.maximum(norm, eps)[:, None]
            if IS_L2:
                dn = x / n
            else:
                ratio = _pow_abs(x / n, p - 1.0)
                dn = tl.where(x < 0, -ratio, ratio)
            dx = tl.where(norm[:, None] > eps, g / n - gx * dn / (n * n), g / eps)
        tl.store(DX + rows[:, None] * D + cols[None, :], to_dtype(dx, DX.dtype.element_ty), mask=ok)
    if HAS_W:
        tl.store(DW_PART + pid * D + cols, dw_acc, mask=d_ok)
    if HAS_B:
        tl.store(DB_PART + pid * D + cols, db_acc, mask=d_ok)

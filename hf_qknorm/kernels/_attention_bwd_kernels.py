"""Triton kernels for the backward of capped flash attention: preprocess (delta), dK/dV and dQ.

FlashAttention-2's backward: P is recomputed from the forward's saved log-sum-exp. Two ways to get dQ, chosen per
tile-table entry (``_tile_table.py``): "separate" runs dK/dV and dQ as two passes (no atomics, deterministic, dS
computed twice); "atomic" (``ATOMIC_DQ``) adds each dK/dV program's dQ contribution into an fp32 buffer with
atomic adds (dS computed once, non-deterministic summation order). Conventions (layouts, log2-domain logits, the
folded cap, the split loops, bottom-right causality) are those of ``_attention_kernels.py``, whose helpers these
kernels share.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._attention_kernels import LOG2E, _allowed, _capped, _key_range, _mask_tile, _query_range, _seq_bounds
from ._common import dot, to_dtype


@triton.jit
def _attn_bwd_preprocess_kernel(
    O,
    DO,
    DLSE,
    DELTA,
    stride_ob,
    stride_oh,
    stride_om,
    stride_dob,
    stride_doh,
    stride_dom,
    num_heads,
    seqlen,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_DLSE: tl.constexpr,
):
    """``delta = rowsum(dO * O) - dLSE`` in fp32, shape (batch, heads, seq) contiguous.

    dS = P * (dP - delta) is the softmax backward; a gradient flowing into the LSE output adds ``P * dLSE`` to dS,
    which is the same as subtracting it from delta, so the main kernels need not know about it."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_heads).to(tl.int64)
    h = (pid_bh % num_heads).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (rows[:, None] < seqlen) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + offs_d[None, :], mask=ok, other=0.0)
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_dom + offs_d[None, :], mask=ok, other=0.0
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row_base = pid_bh.to(tl.int64) * seqlen
    if HAS_DLSE:
        delta -= tl.load(DLSE + row_base + rows, mask=rows < seqlen, other=0.0)
    tl.store(DELTA + row_base + rows, delta, mask=rows < seqlen)


@triton.jit
def _dkdv_loop(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    lse_base,
    delta_base,
    mask_base,
    cols,
    lo,
    hi,
    q_len,
    k_len,
    diag,
    window,
    qk_scale,
    cap_log2,
    stride_qm,
    stride_dom,
    stride_mm,
    stride_mn,
    dq_base,
    stride_dqm,
    scaling,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_MASK: tl.constexpr,
    FAST_TANH: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
):
    """dK and dV of one key block over the query blocks ``range(lo, hi, BLOCK_M)`` of one query head, in
    transposed tiles (keys x queries); ``MASKED=False`` only for blocks ``_query_range`` found wholly allowed.
    With ``ATOMIC_DQ`` each block's ``scaling * dS^T K`` is also added into the fp32 dQ rows at ``dq_base``."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for m0 in range(lo, hi, BLOCK_M):
        rows = m0 + offs_m
        row_ok = rows < q_len
        qt = tl.load(
            q_base + rows[None, :] * stride_qm + offs_d[:, None], mask=row_ok[None, :] & d_ok[:, None], other=0.0
        )
        do = tl.load(
            do_base + rows[:, None] * stride_dom + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
        )
        # Rows past the sequence read LSE = +inf: P is 0 there whatever the mask.
        lse2 = tl.load(lse_base + rows, mask=row_ok, other=float("inf")) * LOG2E
        delta = tl.load(delta_base + rows, mask=row_ok, other=0.0)
        xt = dot(k, qt, None, DOT_PRECISION) * qk_scale
        if HAS_CAP:
            tt = _capped(xt, FAST_TANH)
            pt = tl.math.exp2(tl.fma(tt, cap_log2, -lse2[None, :]))
        else:
            pt = tl.math.exp2(xt - lse2[None, :])
        if MASKED or HAS_MASK:
            ok = _allowed(rows[None, :], cols[:, None], q_len, k_len, diag, window, IS_CAUSAL, HAS_WINDOW)
            if HAS_MASK:
                ok = ok & _mask_tile(mask_base, rows[None, :], cols[:, None], ok, stride_mm, stride_mn)
            pt = tl.where(ok, pt, 0.0)  # on P, not on t: 1 - t^2 below stays finite everywhere
        dv = dot(to_dtype(pt, do.dtype), do, dv, DOT_PRECISION)
        dpt = dot(v, tl.trans(do), None, DOT_PRECISION)
        dst = pt * (dpt - delta[None, :])
        if HAS_CAP:
            dst = dst * (1.0 - tt * tt)  # d(c*tanh(x/c))/dx = 1 - tanh^2, from the recomputed t
        dst = to_dtype(dst, qt.dtype)
        dk = dot(dst, tl.trans(qt), dk, DOT_PRECISION)
        if ATOMIC_DQ:
            dq = dot(tl.trans(dst), k, None, DOT_PRECISION) * scaling
            dq_ok = row_ok[:, None] & d_ok[None, :]
            tl.atomic_add(dq_base + rows[:, None] * stride_dqm + offs_d[None, :], dq, mask=dq_ok, sem="relaxed")
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    DQ,
    MASK,
    CU_Q,
    CU_K,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_dqb,
    stride_dqh,
    stride_dqm,
    stride_lb,
    stride_lh,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_mn,
    num_kv_heads,
    groups,
    seqlen_q,
    seqlen_k,
    qk_scale,
    cap_log2,
    scaling,
    window,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_MASK: tl.constexpr,
    VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FAST_TANH: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
):
    """One program = BLOCK_N keys of one (sequence, KV head); it loops over the ``groups`` query heads that share
    the KV head and over their query blocks, so dK and dV are summed over the GQA group in registers (no atomics,
    deterministic). With ``ATOMIC_DQ``, DQ is a zeroed fp32 buffer into which each group head's dQ is added
    atomically. Grid: (cdiv(max_seqlen_k, BLOCK_N), batch * kv_heads). Works in transposed tiles (keys x queries)
    so that K and V stay as loaded."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_kv_heads
    hk = pid_bh % num_kv_heads
    q_start, q_len, k_start, k_len = _seq_bounds(CU_Q, CU_K, b, seqlen_q, seqlen_k, VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= k_len:
        return
    diag = k_len - q_len
    b64 = b.to(tl.int64)
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    kv_ok = (cols[:, None] < k_len) & d_ok[None, :]
    k_off = b64 * stride_kb + hk.to(tl.int64) * stride_kh + k_start * stride_kn
    k = tl.load(K + k_off + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_ok, other=0.0)
    v_off = b64 * stride_vb + hk.to(tl.int64) * stride_vh + k_start * stride_vn
    v = tl.load(V + v_off + cols[:, None] * stride_vn + offs_d[None, :], mask=kv_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    lo, mid_lo, mid_hi, hi = _query_range(n0, q_len, k_len, diag, window, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW)
    for g in range(groups):
        h = (hk * groups + g).to(tl.int64)
        q_base = Q + b64 * stride_qb + h * stride_qh + q_start * stride_qm
        do_base = DO + b64 * stride_dob + h * stride_doh + q_start * stride_dom
        row_base = b64 * stride_lb + h * stride_lh + q_start  # LSE and DELTA share one layout
        mask_base = MASK + b64 * stride_mb + h * stride_mh
        dq_base = DQ + b64 * stride_dqb + h * stride_dqh + q_start * stride_dqm
        if IS_CAUSAL:  # the diagonal
            dk, dv = _dkdv_loop(
                dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base, mask_base, cols, lo, mid_lo, q_len,
                k_len, diag, window, qk_scale, cap_log2, stride_qm, stride_dom, stride_mm, stride_mn, dq_base,
                stride_dqm, scaling, HEAD_DIM, BLOCK_D, BLOCK_M, True, IS_CAUSAL, HAS_CAP, HAS_WINDOW, HAS_MASK,
                FAST_TANH, DOT_PRECISION, ATOMIC_DQ,
            )  # fmt: skip
        # queries that see every key of the block
        dk, dv = _dkdv_loop(
            dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base, mask_base, cols, mid_lo, mid_hi, q_len,
            k_len, diag, window, qk_scale, cap_log2, stride_qm, stride_dom, stride_mm, stride_mn, dq_base, stride_dqm,
            scaling, HEAD_DIM, BLOCK_D, BLOCK_M, False, IS_CAUSAL, HAS_CAP, HAS_WINDOW, HAS_MASK, FAST_TANH,
            DOT_PRECISION, ATOMIC_DQ,
        )  # fmt: skip
        # the window's edge and the sequence's last queries
        dk, dv = _dkdv_loop(
            dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base, mask_base, cols, mid_hi, hi, q_len,
            k_len, diag, window, qk_scale, cap_log2, stride_qm, stride_dom, stride_mm, stride_mn, dq_base, stride_dqm,
            scaling, HEAD_DIM, BLOCK_D, BLOCK_M, True, IS_CAUSAL, HAS_CAP, HAS_WINDOW, HAS_MASK, FAST_TANH,
            DOT_PRECISION, ATOMIC_DQ,
        )  # fmt: skip
    dk *= scaling
    dk_off = b64 * stride_dkb + hk.to(tl.int64) * stride_dkh + k_start * stride_dkn
    tl.store(DK + dk_off + cols[:, None] * stride_dkn + offs_d[None, :], to_dtype(dk, DK.dtype.element_ty), mask=kv_ok)
    dv_off = b64 * stride_dvb + hk.to(tl.int64) * stride_dvh + k_start * stride_dvn
    tl.store(DV + dv_off + cols[:, None] * stride_dvn + offs_d[None, :], to_dtype(dv, DV.dtype.element_ty), mask=kv_ok)


@triton.jit
def _dq_loop(
    dq,
    q,
    do,
    lse2,
    delta,
    k_base,
    v_base,
    mask_base,
    rows,
    lo,
    hi,
    q_len,
    k_len,
    diag,
    window,
    qk_scale,
    cap_log2,
    stride_kn,
    stride_vn,
    stride_mm,
    stride_mn,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_MASK: tl.constexpr,
    FAST_TANH: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """dQ of one query block over the key blocks ``range(lo, hi, BLOCK_N)`` (the forward's loop, recomputing P from
    the saved LSE); ``MASKED=False`` only for blocks ``_key_range`` found wholly allowed."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        kv_ok = (cols[None, :] < k_len) & d_ok[:, None]
        kt = tl.load(k_base + cols[None, :] * stride_kn + offs_d[:, None], mask=kv_ok, other=0.0)
        vt = tl.load(v_base + cols[None, :] * stride_vn + offs_d[:, None], mask=kv_ok, other=0.0)
        x = dot(q, kt, None, DOT_PRECISION) * qk_scale
        if HAS_CAP:
            t = _capped(x, FAST_TANH)
            p = tl.math.exp2(tl.fma(t, cap_log2, -lse2[:, None]))
        else:
            p = tl.math.exp2(x - lse2[:, None])
        if MASKED or HAS_MASK:
            ok = _allowed(rows[:, None], cols[None, :], q_len, k_len, diag, window, IS_CAUSAL, HAS_WINDOW)
            if HAS_MASK:
                ok = ok & _mask_tile(mask_base, rows[:, None], cols[None, :], ok, stride_mm, stride_mn)
            p = tl.where(ok, p, 0.0)
        dp = dot(do, vt, None, DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if HAS_CAP:
            ds = ds * (1.0 - t * t)
        dq = dot(to_dtype(ds, kt.dtype), tl.trans(kt), dq, DOT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    MASK,
    CU_Q,
    CU_K,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dqb,
    stride_dqh,
    stride_dqm,
    stride_lb,
    stride_lh,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_mn,
    num_heads,
    groups,
    seqlen_q,
    seqlen_k,
    qk_scale,
    cap_log2,
    scaling,
    window,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_MASK: tl.constexpr,
    VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FAST_TANH: tl.constexpr,
):
    """One program = BLOCK_M query rows of one (sequence, query head); recomputes P from the saved LSE over the
    same key blocks as the forward. Grid: (cdiv(max_seqlen_q, BLOCK_M), batch * heads)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    hk = h // groups
    q_start, q_len, k_start, k_len = _seq_bounds(CU_Q, CU_K, b, seqlen_q, seqlen_k, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    diag = k_len - q_len
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row_ok = rows < q_len
    q_ok = row_ok[:, None] & d_ok[None, :]
    q = tl.load(
        Q + b64 * stride_qb + h64 * stride_qh + (q_start + rows[:, None]) * stride_qm + offs_d[None, :],
        mask=q_ok,
        other=0.0,
    )
    do = tl.load(
        DO + b64 * stride_dob + h64 * stride_doh + (q_start + rows[:, None]) * stride_dom + offs_d[None, :],
        mask=q_ok,
        other=0.0,
    )
    row_base = b64 * stride_lb + h64 * stride_lh + q_start
    # Rows past the sequence read LSE = +inf: P is 0 there, also in the unmasked blocks.
    lse2 = tl.load(LSE + row_base + rows, mask=row_ok, other=float("inf")) * LOG2E
    delta = tl.load(DELTA + row_base + rows, mask=row_ok, other=0.0)
    k_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh + k_start * stride_kn
    v_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh + k_start * stride_vn
    mask_base = MASK + b64 * stride_mb + h64 * stride_mh

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = _key_range(m0, k_len, diag, window, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW)
    if HAS_WINDOW:  # the window's left edge
        dq = _dq_loop(
            dq, q, do, lse2, delta, k_base, v_base, mask_base, rows, lo, mid_lo, q_len, k_len, diag, window,
            qk_scale, cap_log2, stride_kn, stride_vn, stride_mm, stride_mn, HEAD_DIM, BLOCK_D, BLOCK_N, True,
            IS_CAUSAL, HAS_CAP, HAS_WINDOW, HAS_MASK, FAST_TANH, DOT_PRECISION,
        )  # fmt: skip
    # keys every row of the tile may see
    dq = _dq_loop(
        dq, q, do, lse2, delta, k_base, v_base, mask_base, rows, mid_lo, mid_hi, q_len, k_len, diag, window, qk_scale,
        cap_log2, stride_kn, stride_vn, stride_mm, stride_mn, HEAD_DIM, BLOCK_D, BLOCK_N, False, IS_CAUSAL, HAS_CAP,
        HAS_WINDOW, HAS_MASK, FAST_TANH, DOT_PRECISION,
    )  # fmt: skip
    # the diagonal and the sequence's last keys
    dq = _dq_loop(
        dq, q, do, lse2, delta, k_base, v_base, mask_base, rows, mid_hi, hi, q_len, k_len, diag, window, qk_scale,
        cap_log2, stride_kn, stride_vn, stride_mm, stride_mn, HEAD_DIM, BLOCK_D, BLOCK_N, True, IS_CAUSAL, HAS_CAP,
        HAS_WINDOW, HAS_MASK, FAST_TANH, DOT_PRECISION,
    )  # fmt: skip
    dq *= scaling
    tl.store(
        DQ + b64 * stride_dqb + h64 * stride_dqh + (q_start + rows[:, None]) * stride_dqm + offs_d[None, :],
        to_dtype(dq, DQ.dtype.element_ty),
        mask=q_ok,
    )

"""Triton kernels for capped flash attention: forward, backward preprocess, dK/dV and dQ.

The algorithm is FlashAttention-2's (Tri Dao, 2023: online softmax over key blocks, the log-sum-exp saved for the
backward, a separate dQ pass so that no atomics are needed); the Triton fused-attention tutorial showed how to lay
it out in Triton. What is added here: the tanh soft cap of Gemma 2 as a compile-time switch, bottom-right aligned
causality, a sliding window, a dense boolean mask read tile by tile, packed (varlen) sequences and GQA without
repeating K/V. Design notes: docs/kernels.md.

Conventions used by every kernel
--------------------------------
* Tensors are ``(batch, heads, seq, head_dim)`` with ``head_dim`` contiguous; any other strides are passed in.
  For packed sequences the batch dimension is 1, sequence ``b`` occupies rows ``cu_seqlens[b]:cu_seqlens[b+1]``
  of the ``seq`` axis, and the launcher passes batch strides of 0.
* Logits are kept in the base-2 domain (``s * log2(e)``) so the exponentials are ``exp2``; the saved LSE is in
  natural log units. ``qk_scale`` is ``scaling * log2(e)`` without a cap and ``scaling / softcap`` with one, in
  which case the log2-domain logit is ``cap_log2 * tanh(qk * qk_scale)`` with ``cap_log2 = softcap * log2(e)``.
* Query ``i`` of a sequence sits at absolute position ``i + k_len - q_len`` (bottom-right alignment, as in
  flash-attn >= 2.1 and in a KV cache); ``diag = k_len - q_len``.
* A row with no allowed key outputs 0 and gets ``lse = +inf``, so that ``exp(s - lse) = 0`` in the backward.
* ``RETURN_MAX`` (a constexpr: the ordinary kernel is unchanged) also writes each row's largest pre-cap logit
  ``scaling * q.k`` over its allowed keys (``-inf`` for a row with none), for per-head max-logit telemetry: without a
  cap that is the online softmax's running maximum ``m_i`` itself; with one, ``m_i`` is taken after the cap, so the
  pre-cap maximum is tracked beside it rather than inverted through a saturating ``tanh``.
* Base offsets (batch, head, sequence start) are computed in int64: a large KV cache overflows int32 offsets.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import dot, to_dtype

# constexpr globals: jit code may only read globals wrapped in tl.constexpr
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


# tanh without libdevice (the interpreter has none), accurate *relative to tanh(x)* for every x. It matters because
# the logit is c * tanh(s / c): with a large cap c the argument is tiny and tanh(x) ~ x, so an absolute error of
# 1e-7 (2 * sigmoid(2x) - 1, which cancels for small x) became ~1e-7 c in the logit -- 0.1 at c = 1e6.
# |x| < TANH_SPLIT: the odd polynomial x + x z P(z), z = x^2, P a degree-4 minimax fit of (tanh(x)/x - 1)/z
# (relative error 1e-9 in exact arithmetic; refit with `python scripts/fit_tanh.py`). Elsewhere
# (1 - e) / (1 + e) with e = exp(-2|x|) <= 0.33: no cancellation, no overflow (e underflows to 0 for huge |x|),
# NaN stays NaN. Measured in float32 (numpy, as the interpreter computes it): at most 2e-7 relative error.
TANH_SPLIT = tl.constexpr(0.55)
TANH_P0 = tl.constexpr(-0.33333316445350647)
TANH_P1 = tl.constexpr(0.13332585990428925)
TANH_P2 = tl.constexpr(-0.05385230854153633)
TANH_P3 = tl.constexpr(0.021071679890155792)
TANH_P4 = tl.constexpr(-0.0062742410227656364)


@triton.jit
def _tanh(x):
    """``tanh(x)`` in float32 with a relative error of a few ulps for every ``x`` (see the comment above)."""
    a = tl.abs(x)
    small = a < TANH_SPLIT
    s = tl.where(small, a, 0.0)  # the polynomial never sees a large argument (no overflow in the unused lane)
    z = s * s
    poly = s + s * z * ((((TANH_P4 * z + TANH_P3) * z + TANH_P2) * z + TANH_P1) * z + TANH_P0)
    e = tl.exp(-2.0 * a)
    t = tl.where(small, poly, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _seq_bounds(CU_Q, CU_K, b, seqlen_q, seqlen_k, VARLEN: tl.constexpr):
    """Start row and length of sequence ``b`` in the query and key tensors."""
    if VARLEN:
        q_start = tl.load(CU_Q + b)
        q_len = tl.load(CU_Q + b + 1) - q_start
        k_start = tl.load(CU_K + b)
        k_len = tl.load(CU_K + b + 1) - k_start
        return q_start.to(tl.int64), q_len, k_start.to(tl.int64), k_len
    else:
        return 0, seqlen_q, 0, seqlen_k


@triton.jit
def _logits(qk, qk_scale, cap_log2, HAS_CAP: tl.constexpr):
    """Raw ``q.k`` products -> log2-domain logits, and the tanh value the backward needs for ``1 - t^2``."""
    if HAS_CAP:
        t = _tanh(qk * qk_scale)
        return t * cap_log2, t
    else:
        return qk * qk_scale, qk


@triton.jit
def _allowed(qpos, kpos, q_len, k_len, diag, window, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Which (query, key) pairs may attend; ``qpos``/``kpos`` are broadcastable 2-D index tiles.
    Out-of-range rows and columns are never allowed, so the caller needs no other bounds mask."""
    ok = (qpos < q_len) & (kpos < k_len)
    if IS_CAUSAL:
        ok = ok & (kpos <= qpos + diag)
    if HAS_WINDOW:
        ok = ok & (qpos + diag - kpos < window)
    return ok


@triton.jit
def _mask_tile(mask_base, qpos, kpos, ok, stride_mm, stride_mn):
    """The user's boolean mask (stored as uint8, True = attend) for one tile; not read where ``ok`` is False.
    Row offsets in int64: a dense (q_len, kv_len) mask passes 2**31 elements at 46k x 46k."""
    return tl.load(mask_base + qpos.to(tl.int64) * stride_mm + kpos * stride_mn, mask=ok, other=0) != 0


@triton.jit
def _key_range(
    m0,
    k_len,
    diag,
    window,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Key blocks that a query block ``[m0, m0 + BLOCK_M)`` can see: skipping the rest is where causal and
    windowed attention save their work. ``lo`` is a multiple of BLOCK_N; ``hi <= lo`` means nothing to do."""
    lo = 0
    hi = k_len
    if IS_CAUSAL:
        hi = tl.minimum(hi, m0 + BLOCK_M + diag)
    if HAS_WINDOW:
        lo = tl.maximum(m0 + diag - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    return lo, hi


@triton.jit
def _attn_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    MX,
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
    stride_ob,
    stride_oh,
    stride_om,
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
    RETURN_MAX: tl.constexpr,
):
    """One program = BLOCK_M query rows of one (sequence, query head). Grid: (cdiv(max_seqlen_q, BLOCK_M),
    batch * heads). Writes O (input dtype), LSE (fp32, natural log) and, with RETURN_MAX, MX (fp32, LSE's layout)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    hk = h // groups  # GQA: the K/V head this query head reads; K/V are never repeated in memory
    q_start, q_len, k_start, k_len = _seq_bounds(CU_Q, CU_K, b, seqlen_q, seqlen_k, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    diag = k_len - q_len
    b64 = b.to(tl.int64)
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM  # BLOCK_D is head_dim padded to a power of two (80 -> 128)

    q_base = Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + q_start * stride_qm
    q = tl.load(
        q_base + rows[:, None] * stride_qm + offs_d[None, :], mask=(rows[:, None] < q_len) & d_ok[None, :], other=0.0
    )
    k_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh + k_start * stride_kn
    v_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh + k_start * stride_vn
    mask_base = MASK + b64 * stride_mb + h.to(tl.int64) * stride_mh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    x_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # RETURN_MAX with a cap: max of s / c
    lo, hi = _key_range(m0, k_len, diag, window, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        kt = tl.load(
            k_base + cols[None, :] * stride_kn + offs_d[:, None],
            mask=(cols[None, :] < k_len) & d_ok[:, None],
            other=0.0,
        )
        qk = dot(q, kt, None, DOT_PRECISION)
        s, _t = _logits(qk, qk_scale, cap_log2, HAS_CAP)  # cap before the mask, as in Gemma 2
        ok = _allowed(rows[:, None], cols[None, :], q_len, k_len, diag, window, IS_CAUSAL, HAS_WINDOW)
        if HAS_MASK:
            ok = ok & _mask_tile(mask_base, rows[:, None], cols[None, :], ok, stride_mm, stride_mn)
        if RETURN_MAX and HAS_CAP:
            x_max = tl.maximum(x_max, tl.max(tl.where(ok, qk * qk_scale, float("-inf")), 1))
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no allowed key yet keeps m = -inf; shift by 0 instead so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + cols[:, None] * stride_vn + offs_d[None, :],
            mask=(cols[:, None] < k_len) & d_ok[None, :],
            other=0.0,
        )
        # P is rounded to the input dtype for the tensor-core product, as in FlashAttention-2.
        acc = dot(to_dtype(p, v.dtype), v, acc * alpha[:, None], DOT_PRECISION)
        m_i = m_new

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]  # empty rows: acc is 0, so the output is 0
    lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    o_base = O + b64 * stride_ob + h.to(tl.int64) * stride_oh + q_start * stride_om
    tl.store(
        o_base + rows[:, None] * stride_om + offs_d[None, :],
        to_dtype(out, O.dtype.element_ty),
        mask=(rows[:, None] < q_len) & d_ok[None, :],
    )
    row_off = b64 * stride_lb + h.to(tl.int64) * stride_lh + q_start
    tl.store(LSE + row_off + rows, lse, mask=rows < q_len)
    if RETURN_MAX:
        tl.store(MX + row_off + rows, _pre_cap_max(m_i, x_max, cap_log2, HAS_CAP), mask=rows < q_len)


@triton.jit
def _pre_cap_max(m_i, x_max, cap_log2, HAS_CAP: tl.constexpr):
    """A row's largest pre-cap logit in natural units: ``x_max * c`` (``x = s / c``) with a cap, else the running
    maximum ``m_i`` of ``s * log2(e)`` taken back to natural units."""
    if HAS_CAP:
        return x_max * (cap_log2 * LN2)
    else:
        return m_i * LN2


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
def _attn_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
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
):
    """One program = BLOCK_N keys of one (sequence, KV head); it loops over the ``groups`` query heads that share
    the KV head and over their query blocks, so dK and dV are summed over the GQA group in registers (no atomics,
    deterministic). Grid: (cdiv(max_seqlen_k, BLOCK_N), batch * kv_heads). Works in transposed tiles (keys x
    queries) so that K and V stay as loaded."""
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
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    kv_ok = (cols[:, None] < k_len) & d_ok[None, :]
    k_off = b64 * stride_kb + hk.to(tl.int64) * stride_kh + k_start * stride_kn
    k = tl.load(K + k_off + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_ok, other=0.0)
    v_off = b64 * stride_vb + hk.to(tl.int64) * stride_vh + k_start * stride_vn
    v = tl.load(V + v_off + cols[:, None] * stride_vn + offs_d[None, :], mask=kv_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Query blocks that can see this key block (the mirror image of _key_range).
    lo = 0
    hi = q_len
    if IS_CAUSAL:
        lo = tl.maximum(n0 - diag, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
    if HAS_WINDOW:
        hi = tl.minimum(hi, n0 + BLOCK_N - 1 + window - diag)
    for g in range(groups):
        h = (hk * groups + g).to(tl.int64)
        q_base = Q + b64 * stride_qb + h * stride_qh + q_start * stride_qm
        do_base = DO + b64 * stride_dob + h * stride_doh + q_start * stride_dom
        row_base = b64 * stride_lb + h * stride_lh + q_start  # LSE and DELTA share one layout
        mask_base = MASK + b64 * stride_mb + h * stride_mh
        for m0 in range(lo, hi, BLOCK_M):
            rows = m0 + offs_m
            row_ok = rows < q_len
            qt = tl.load(
                q_base + rows[None, :] * stride_qm + offs_d[:, None], mask=row_ok[None, :] & d_ok[:, None], other=0.0
            )
            do = tl.load(
                do_base + rows[:, None] * stride_dom + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
            )
            lse2 = tl.load(LSE + row_base + rows, mask=row_ok, other=0.0) * LOG2E
            delta = tl.load(DELTA + row_base + rows, mask=row_ok, other=0.0)
            st, tt = _logits(dot(k, qt, None, DOT_PRECISION), qk_scale, cap_log2, HAS_CAP)
            ok = _allowed(rows[None, :], cols[:, None], q_len, k_len, diag, window, IS_CAUSAL, HAS_WINDOW)
            if HAS_MASK:
                ok = ok & _mask_tile(mask_base, rows[None, :], cols[:, None], ok, stride_mm, stride_mn)
            pt = tl.where(ok, tl.math.exp2(st - lse2[None, :]), 0.0)
            dv = dot(to_dtype(pt, do.dtype), do, dv, DOT_PRECISION)
            dpt = dot(v, tl.trans(do), None, DOT_PRECISION)
            dst = pt * (dpt - delta[None, :])
            if HAS_CAP:
                dst = dst * (1.0 - tt * tt)  # d(c*tanh(x/c))/dx = 1 - tanh^2
            dk = dot(to_dtype(dst, qt.dtype), tl.trans(qt), dk, DOT_PRECISION)
    dk *= scaling
    dk_off = b64 * stride_dkb + hk.to(tl.int64) * stride_dkh + k_start * stride_dkn
    tl.store(DK + dk_off + cols[:, None] * stride_dkn + offs_d[None, :], to_dtype(dk, DK.dtype.element_ty), mask=kv_ok)
    dv_off = b64 * stride_dvb + hk.to(tl.int64) * stride_dvh + k_start * stride_dvn
    tl.store(DV + dv_off + cols[:, None] * stride_dvn + offs_d[None, :], to_dtype(dv, DV.dtype.element_ty), mask=kv_ok)


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
    offs_n = tl.arange(0, BLOCK_N)
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
    lse2 = tl.load(LSE + row_base + rows, mask=row_ok, other=0.0) * LOG2E
    delta = tl.load(DELTA + row_base + rows, mask=row_ok, other=0.0)
    k_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh + k_start * stride_kn
    v_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh + k_start * stride_vn
    mask_base = MASK + b64 * stride_mb + h64 * stride_mh

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, hi = _key_range(m0, k_len, diag, window, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        kv_ok = (cols[None, :] < k_len) & d_ok[:, None]
        kt = tl.load(k_base + cols[None, :] * stride_kn + offs_d[:, None], mask=kv_ok, other=0.0)
        vt = tl.load(v_base + cols[None, :] * stride_vn + offs_d[:, None], mask=kv_ok, other=0.0)
        s, t = _logits(dot(q, kt, None, DOT_PRECISION), qk_scale, cap_log2, HAS_CAP)
        ok = _allowed(rows[:, None], cols[None, :], q_len, k_len, diag, window, IS_CAUSAL, HAS_WINDOW)
        if HAS_MASK:
            ok = ok & _mask_tile(mask_base, rows[:, None], cols[None, :], ok, stride_mm, stride_mn)
        p = tl.where(ok, tl.math.exp2(s - lse2[:, None]), 0.0)
        dp = dot(do, vt, None, DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if HAS_CAP:
            ds = ds * (1.0 - t * t)
        dq = dot(to_dtype(ds, kt.dtype), tl.trans(kt), dq, DOT_PRECISION)
    dq *= scaling
    tl.store(
        DQ + b64 * stride_dqb + h64 * stride_dqh + (q_start + rows[:, None]) * stride_dqm + offs_d[None, :],
        to_dtype(dq, DQ.dtype.element_ty),
        mask=q_ok,
    )

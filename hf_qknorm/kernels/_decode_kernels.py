"""Triton kernels for the decoding-shaped forward: few query rows, a long KV cache.

The general forward gives each (sequence, query head) its own programs, so with ``q_len = 1`` a program computes one
useful row out of BLOCK_M, the KV cache is read once per *query* head, and there are only ``batch * heads`` programs
to spread over the GPU. Two standard fixes, combined here:

* **GQA packing** (FlashAttention-3's ``pack_gqa``): a tile's rows are the ``(query, head)`` pairs of one KV head's
  group, so K/V are read once per KV head and the rows are actually used.
* **Split-KV** ("flash-decoding", Tri Dao, Daniel Haziza, Francisco Massa, Grigory Sizov, 2023): the keys are cut
  into ``num_splits`` chunks processed by different programs, each writing an unnormalised partial (output, LSE);
  a small combine kernel merges them exactly with a log-sum-exp.

The LSE produced is the same as the general forward's, so the ordinary backward kernels apply unchanged. Same
conventions as ``_attention_kernels.py`` (log2-domain logits, bottom-right causality, ``+inf`` LSE on empty rows).
No varlen here: packed batches go through the general forward.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._attention_kernels import LN2, _allowed, _capped, _pre_cap_max
from ._common import dot, to_dtype


@triton.jit
def _attn_fwd_split_kernel(
    Q,
    K,
    V,
    OP,
    LSEP,
    MXP,
    MASK,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_mn,
    batch,
    num_heads,
    num_kv_heads,
    groups,
    seqlen_q,
    seqlen_k,
    split_len,
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
    DOT_PRECISION: tl.constexpr,
    RETURN_MAX: tl.constexpr,
    FAST_TANH: tl.constexpr,
):
    """Grid: (num_splits, batch * kv_heads, cdiv(q_len * groups, BLOCK_M)). Row ``r`` of a tile is query
    ``r // groups`` of head ``kv_head * groups + r % groups``. Keys ``[split * split_len, (split + 1) * split_len)``
    (``split_len`` a multiple of BLOCK_N). Writes OP (fp32, (splits, batch, heads, q_len, head_dim), already divided
    by its own row sum) and LSEP (fp32, (splits, batch, heads, q_len), log2 units, -inf where nothing was seen); with
    RETURN_MAX also MXP (LSEP's layout): each row's largest pre-cap logit over the split's allowed keys, in natural
    units (see ``_attention_kernels.py``)."""
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = pid_bh // num_kv_heads
    hk = pid_bh % num_kv_heads
    b64 = b.to(tl.int64)
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < seqlen_q * groups
    qi = r // groups
    h = hk * groups + r % groups
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    diag = seqlen_k - seqlen_q

    q_rows = b64 * stride_qb + h.to(tl.int64) * stride_qh + qi.to(tl.int64) * stride_qm
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh
    mask_rows = MASK + b64 * stride_mb + h.to(tl.int64) * stride_mh + qi.to(tl.int64) * stride_mm

    # keys this split owns, narrowed to what the tile's queries can see
    q_first = (pid_m * BLOCK_M) // groups
    q_last = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // groups, seqlen_q - 1)
    lo = pid_s * split_len
    hi = tl.minimum(lo + split_len, seqlen_k)
    if IS_CAUSAL:
        hi = tl.minimum(hi, q_last + 1 + diag)
    if HAS_WINDOW:
        lo = tl.maximum(lo, ((q_first + diag - window + 1) // BLOCK_N) * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    x_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        kv_ok = cols < seqlen_k
        kt = tl.load(
            k_base + cols[None, :] * stride_kn + offs_d[:, None], mask=kv_ok[None, :] & d_ok[:, None], other=0.0
        )
        x = dot(q, kt, None, DOT_PRECISION) * qk_scale
        ok = _allowed(qi[:, None], cols[None, :], seqlen_q, seqlen_k, diag, window, IS_CAUSAL, HAS_WINDOW)
        ok = ok & row_ok[:, None]
        if HAS_MASK:
            ok = ok & (tl.load(mask_rows[:, None] + cols[None, :] * stride_mn, mask=ok, other=0) != 0)
        if RETURN_MAX and HAS_CAP:
            x_max = tl.maximum(x_max, tl.max(tl.where(ok, x, float("-inf")), 1))
        # As in _attn_fwd_kernel: the mask after the tanh, cap_log2 folded into the exponential as one FMA.
        if HAS_CAP:
            t = tl.where(ok, _capped(x, FAST_TANH), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(t, 1) * cap_log2)
        else:
            s = tl.where(ok, x, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        if HAS_CAP:
            p = tl.math.exp2(tl.fma(t, cap_log2, -m_safe[:, None]))
        else:
            p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=kv_ok[:, None] & d_ok[None, :], other=0.0
        )
        acc = dot(to_dtype(p, v.dtype), v, acc * alpha[:, None], DOT_PRECISION)
        m_i = m_new

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe))
    # partial row index ((split * batch + b) * heads + h) * q_len + qi
    prow = ((pid_s * batch + b).to(tl.int64) * num_heads + h) * seqlen_q + qi
    tl.store(
        OP + prow[:, None] * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None], mask=row_ok[:, None] & d_ok[None, :]
    )
    tl.store(LSEP + prow, lse2, mask=row_ok)
    if RETURN_MAX:
        tl.store(MXP + prow, _pre_cap_max(m_i, x_max, cap_log2, HAS_CAP), mask=row_ok)


@triton.jit
def _attn_combine_kernel(
    OP,
    LSEP,
    O,
    LSE,
    stride_ob,
    stride_oh,
    stride_om,
    num_splits,
    split_stride,
    num_heads,
    seqlen_q,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Merge the splits: ``lse = log sum_s exp(lse_s)``, ``o = sum_s exp(lse_s - lse) o_s``. Grid:
    (cdiv(q_len, BLOCK_M), batch * heads). Writes O (output dtype, any strides) and LSE (fp32, contiguous,
    natural log, +inf on empty rows)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < seqlen_q
    ok = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for s in range(num_splits):  # split_stride = batch * heads * q_len rows per split
        prow = pid_bh.to(tl.int64) * seqlen_q + s * split_stride + rows
        lse_s = tl.load(LSEP + prow, mask=row_ok, other=float("-inf"))
        o_s = tl.load(OP + prow[:, None] * HEAD_DIM + offs_d[None, :], mask=ok, other=0.0)
        m_new = tl.maximum(m, lse_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - m_safe)
        w = tl.math.exp2(lse_s - m_safe)
        total = total * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o_s
        m = m_new
    empty = total == 0.0
    t_safe = tl.where(empty, 1.0, total)
    out = acc / t_safe[:, None]
    lse = tl.where(empty, float("inf"), (m + tl.math.log2(t_safe)) * LN2)
    o_base = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    tl.store(o_base + rows[:, None] * stride_om + offs_d[None, :], to_dtype(out, O.dtype.element_ty), mask=ok)
    tl.store(LSE + pid_bh.to(tl.int64) * seqlen_q + rows, lse, mask=row_ok)

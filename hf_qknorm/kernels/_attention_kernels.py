"""Triton kernels for capped flash attention: the forward and the helpers every attention kernel shares.

The algorithm is FlashAttention-2's (Tri Dao, 2023: online softmax over key blocks, the log-sum-exp saved for the
backward, a separate dQ pass so that no atomics are needed); the Triton fused-attention tutorial showed how to lay
it out in Triton. What is added here: the tanh soft cap of Gemma 2 as a compile-time switch, bottom-right aligned
causality, a sliding window, a dense boolean mask read tile by tile, packed (varlen) sequences and GQA without
repeating K/V. The backward kernels are in ``_attention_bwd_kernels.py``, the decoding-shaped forward in
``_decode_kernels.py``. Design notes: docs/kernels.md.

Conventions used by every kernel
--------------------------------
* Tensors are ``(batch, heads, seq, head_dim)`` with ``head_dim`` contiguous; any other strides are passed in.
  For packed sequences the batch dimension is 1, sequence ``b`` occupies rows ``cu_seqlens[b]:cu_seqlens[b+1]``
  of the ``seq`` axis, and the launcher passes batch strides of 0.
* Logits are kept in the base-2 domain (``s * log2(e)``) so the exponentials are ``exp2``; the saved LSE is in
  natural log units. ``qk_scale`` is ``scaling * log2(e)`` without a cap and ``scaling / softcap`` with one, in
  which case the log2-domain logit is ``cap_log2 * tanh(qk * qk_scale)`` with ``cap_log2 = softcap * log2(e)``:
  one multiply before the tanh, and ``cap_log2`` folded into the exponential's argument as one FMA,
  ``exp2(fma(t, cap_log2, -m))`` (FlashAttention-2's folding). The mask is applied to ``t``, after the tanh.
* ``FAST_TANH`` (a constexpr) computes that tanh with the GPU's ``tanh.approx.f32``; otherwise ``_tanh`` below,
  exact to a few ulps. The launcher sets it only for fp16/bf16 inputs on NVIDIA GPUs, never under the interpreter
  (which cannot run inline assembly) nor when ``HF_QKNORM_EXACT_TANH`` asks for the exact tanh.
* Causal and windowed loops are split (``_key_range``, ``_query_range``): blocks that every row of the tile may see
  in full run without computing or applying a mask (``MASKED=False``); only the blocks on the diagonal, the window's
  edge and the sequence's end are masked element-wise. A dense mask is applied to every block.
* The backward recomputes ``t`` and multiplies dS by ``1 - t^2`` in registers (nothing stored); ``P`` is zeroed at
  masked positions with ``where`` after the exponential, and ``t`` is never set to ``-inf``, so ``1 - t^2`` stays
  finite there (FlashAttention-3 computes it before masking for the same reason).
* Query ``i`` of a sequence sits at absolute position ``i + k_len - q_len`` (bottom-right alignment, as in
  flash-attn >= 2.1 and in a KV cache); ``diag = k_len - q_len``.
* A row with no allowed key outputs 0 and gets ``lse = +inf``, so that ``exp(s - lse) = 0`` in the backward.
* ``RETURN_MAX`` (a constexpr: the ordinary kernel is unchanged) also writes each row's largest pre-cap logit
  ``scaling * q.k`` over its allowed keys (``-inf`` for a row with none), for per-head max-logit telemetry: without a
  cap that is the online softmax's running maximum ``m_i`` itself; with one, ``m_i`` is taken after the cap, so the
  pre-cap maximum is tracked beside it rather than inverted through a saturating ``tanh``.
* Base offsets (batch, head, sequence start) are computed in int64: a large KV cache overflows int32 offsets.
* ``TMA`` (a constexpr, the forward only) loads Q, K and V through tensor descriptors built in the kernel, one per
  (sequence, head), bounded by that sequence's length: a load past it reads zeros, as the masked pointer loads
  do. On Hopper and later these are TMA copies. The launcher sets it only where it applies (``attention._tma``).
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
def _tanh_approx(x):
    """``tanh.approx.f32`` (sm_75+): one special-function instruction, relative error about 2^-11 -- what
    FlashAttention-2 (``cutlass::fast_tanh``) and FlashInfer ship for the soft cap. CUDA only: the interpreter
    cannot run inline assembly, so the launcher never selects it there."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _capped(x, FAST_TANH: tl.constexpr):
    """``tanh(x)`` for ``x = q.k * scaling / c``: the hardware approximation or the exact ``_tanh``."""
    if FAST_TANH:
        t = _tanh_approx(x)
    else:
        t = _tanh(x)
    return t


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
def _split(lo, first, last, hi):
    """``[lo, hi)`` cut into ``[lo, mid_lo)``, ``[mid_lo, mid_hi)``, ``[mid_hi, hi)``, with the middle part inside
    ``[first, last)`` (where no element needs a mask) and ``lo <= mid_lo <= mid_hi`` always, so the three loops
    together visit exactly the blocks of ``range(lo, hi, BLOCK)``."""
    mid_lo = tl.maximum(tl.minimum(first, hi), lo)
    mid_hi = tl.maximum(tl.minimum(last, hi), mid_lo)
    return mid_lo, mid_hi


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
    """Key blocks that a query block ``[m0, m0 + BLOCK_M)`` can see -- skipping the rest is where causal and
    windowed attention save their work -- as ``(lo, mid_lo, mid_hi, hi)``: blocks in ``[mid_lo, mid_hi)`` are
    allowed for every row of the tile and run unmasked; those in ``[lo, mid_lo)`` (the window's edge) and
    ``[mid_hi, hi)`` (the diagonal, the last keys) are masked. ``lo``, ``mid_lo`` and ``mid_hi`` are multiples of
    BLOCK_N; ``hi <= lo`` means nothing to do. Tile rows past ``q_len`` are not considered: their queries are loaded
    as zeros and their results never stored. Divisions only see non-negative numbers (C and Python round negative
    quotients differently, and the interpreter is Python)."""
    lo = 0
    hi = k_len
    if IS_CAUSAL:
        hi = tl.minimum(hi, m0 + BLOCK_M + diag)
    if HAS_WINDOW:
        lo = tl.maximum(m0 + diag - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    # Unmasked blocks: the tile's first row sees keys up to m0 + diag (causal), its last row keys from
    # m0 + BLOCK_M + diag - window on (window), and no key is past the sequence's end.
    first = lo
    if HAS_WINDOW:
        first = tl.maximum(m0 + BLOCK_M + diag - window, 0)
        first = (first + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    last = k_len
    if IS_CAUSAL:
        last = tl.minimum(last, m0 + diag + 1)
    last = (tl.maximum(last, 0) // BLOCK_N) * BLOCK_N
    mid_lo, mid_hi = _split(lo, first, last, hi)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _query_range(
    n0,
    q_len,
    k_len,
    diag,
    window,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """The mirror image of ``_key_range`` for the dK/dV kernel: query blocks that can see the key block
    ``[n0, n0 + BLOCK_N)``, as ``(lo, mid_lo, mid_hi, hi)`` with the same meaning. A query block is unmasked only if
    all its rows are in the sequence and the key block is too (those rows and keys are real here)."""
    lo = 0
    hi = q_len
    if IS_CAUSAL:
        lo = tl.maximum(n0 - diag, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
    if HAS_WINDOW:
        hi = tl.minimum(hi, n0 + BLOCK_N - 1 + window - diag)
    # Unmasked blocks: the tile's first query sees the last key (causal), its last query the first key (window).
    first = lo
    if IS_CAUSAL:
        first = tl.maximum(n0 + BLOCK_N - 1 - diag, 0)
        first = (first + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    last = q_len
    if HAS_WINDOW:
        last = tl.minimum(last, n0 + window - diag)
    last = (tl.maximum(last, 0) // BLOCK_M) * BLOCK_M
    last = tl.where(n0 + BLOCK_N <= k_len, last, 0)  # a key block cut by the sequence's end is always masked
    mid_lo, mid_hi = _split(lo, first, last, hi)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _fwd_loop(
    acc,
    l_i,
    m_i,
    x_max,
    q,
    k_src,
    v_src,
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
    RETURN_MAX: tl.constexpr,
    TMA: tl.constexpr,
):
    """The online softmax over key blocks ``range(lo, hi, BLOCK_N)``; ``MASKED=False`` only for blocks that
    ``_key_range`` found allowed for every row. ``k_src``/``v_src`` are the sequence's K/V base pointers, or with
    ``TMA`` their tensor descriptors. Returns the updated ``(acc, l_i, m_i, x_max)``."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        if TMA:
            kt = tl.trans(k_src.load([n0, 0]))
        else:
            kt = tl.load(
                k_src + cols[None, :] * stride_kn + offs_d[:, None],
                mask=(cols[None, :] < k_len) & d_ok[:, None],
                other=0.0,
            )
        qk = dot(q, kt, None, DOT_PRECISION)
        # z is the logit before its last factor: t = tanh(x) with a cap (times cap_log2 below), else s * log2(e).
        x = qk * qk_scale
        if HAS_CAP:
            z = _capped(x, FAST_TANH)
        else:
            z = x
        if MASKED or HAS_MASK:
            ok = _allowed(rows[:, None], cols[None, :], q_len, k_len, diag, window, IS_CAUSAL, HAS_WINDOW)
            if HAS_MASK:
                ok = ok & _mask_tile(mask_base, rows[:, None], cols[None, :], ok, stride_mm, stride_mn)
            if RETURN_MAX and HAS_CAP:
                x_max = tl.maximum(x_max, tl.max(tl.where(ok, x, float("-inf")), 1))
            z = tl.where(ok, z, float("-inf"))  # the mask after the cap, as in Gemma 2 and FlashAttention
        elif RETURN_MAX and HAS_CAP:
            x_max = tl.maximum(x_max, tl.max(x, 1))
        if HAS_CAP:
            m_new = tl.maximum(m_i, tl.max(z, 1) * cap_log2)  # cap_log2 > 0: the largest t gives the largest logit
        else:
            m_new = tl.maximum(m_i, tl.max(z, 1))
        # A row that has seen no allowed key yet keeps m = -inf; shift by 0 instead so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        if HAS_CAP:
            p = tl.math.exp2(tl.fma(z, cap_log2, -m_safe[:, None]))
        else:
            p = tl.math.exp2(z - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if TMA:
            v = v_src.load([n0, 0])
        else:
            v = tl.load(
                v_src + cols[:, None] * stride_vn + offs_d[None, :],
                mask=(cols[:, None] < k_len) & d_ok[None, :],
                other=0.0,
            )
        # P is rounded to the input dtype for the tensor-core product, as in FlashAttention-2.
        acc = dot(to_dtype(p, v.dtype), v, acc * alpha[:, None], DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i, x_max


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
    FAST_TANH: tl.constexpr,
    TMA: tl.constexpr,
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
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM  # BLOCK_D is head_dim padded to a power of two (80 -> 128)

    q_base = Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + q_start * stride_qm
    k_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh + k_start * stride_kn
    v_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh + k_start * stride_vn
    if TMA:
        # Bounded by this sequence's length: rows and keys past it load as zeros, like the masked loads below.
        q_desc = tl.make_tensor_descriptor(q_base, [q_len, HEAD_DIM], [stride_qm, 1], [BLOCK_M, BLOCK_D])
        k_src = tl.make_tensor_descriptor(k_base, [k_len, HEAD_DIM], [stride_kn, 1], [BLOCK_N, BLOCK_D])
        v_src = tl.make_tensor_descriptor(v_base, [k_len, HEAD_DIM], [stride_vn, 1], [BLOCK_N, BLOCK_D])
        q = q_desc.load([m0, 0])
    else:
        q = tl.load(
            q_base + rows[:, None] * stride_qm + offs_d[None, :],
            mask=(rows[:, None] < q_len) & d_ok[None, :],
            other=0.0,
        )
        k_src = k_base
        v_src = v_base
    mask_base = MASK + b64 * stride_mb + h.to(tl.int64) * stride_mh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    x_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # RETURN_MAX with a cap: max of s / c
    lo, mid_lo, mid_hi, hi = _key_range(m0, k_len, diag, window, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW)
    if HAS_WINDOW:  # the window's left edge
        acc, l_i, m_i, x_max = _fwd_loop(
            acc, l_i, m_i, x_max, q, k_src, v_src, mask_base, rows, lo, mid_lo, q_len, k_len, diag, window,
            qk_scale, cap_log2, stride_kn, stride_vn, stride_mm, stride_mn, HEAD_DIM, BLOCK_D, BLOCK_N, True,
            IS_CAUSAL, HAS_CAP, HAS_WINDOW, HAS_MASK, FAST_TANH, DOT_PRECISION, RETURN_MAX, TMA,
        )  # fmt: skip
    # keys every row of the tile may see
    acc, l_i, m_i, x_max = _fwd_loop(
        acc, l_i, m_i, x_max, q, k_src, v_src, mask_base, rows, mid_lo, mid_hi, q_len, k_len, diag, window, qk_scale,
        cap_log2, stride_kn, stride_vn, stride_mm, stride_mn, HEAD_DIM, BLOCK_D, BLOCK_N, False, IS_CAUSAL,
        HAS_CAP, HAS_WINDOW, HAS_MASK, FAST_TANH, DOT_PRECISION, RETURN_MAX, TMA,
    )  # fmt: skip
    # the diagonal and the sequence's last keys
    acc, l_i, m_i, x_max = _fwd_loop(
        acc, l_i, m_i, x_max, q, k_src, v_src, mask_base, rows, mid_hi, hi, q_len, k_len, diag, window, qk_scale,
        cap_log2, stride_kn, stride_vn, stride_mm, stride_mn, HEAD_DIM, BLOCK_D, BLOCK_N, True, IS_CAUSAL,
        HAS_CAP, HAS_WINDOW, HAS_MASK, FAST_TANH, DOT_PRECISION, RETURN_MAX, TMA,
    )  # fmt: skip

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

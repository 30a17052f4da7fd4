"""Capped flash attention in Triton: the launchers and the ``torch.library`` custom ops.

Ladder: ``_attn_*_kernel`` (``_attention_kernels.py``, ``_attention_bwd_kernels.py``, ``_decode_kernels.py``) ->
``attn_fwd()`` / ``attn_bwd()`` launchers here (shape and dtype checks, tiles, grids) ->
``torch.ops.hf_qknorm.attn_fwd`` / ``attn_fwd_max`` / ``attn_bwd`` custom ops here (fake + autograd, so they work
under ``torch.compile``) -> the public entry points in :mod:`.attn_interface` (``qknorm_attn_func``,
``qknorm_attn_varlen_func``, ``qknorm_attn_with_kvcache``, ...).

Layouts
-------
* Padded batch: ``q`` ``(batch, heads, q_len, head_dim)``, ``k``/``v`` ``(batch, kv_heads, kv_len, head_dim)``.
  Any strides with a contiguous last dimension (e.g. the ``transpose(1, 2)`` views Transformers passes) are read
  in place.
* Packed (varlen) sequences: ``q`` ``(1, heads, total_q, head_dim)``, ``k``/``v`` ``(1, kv_heads, total_k,
  head_dim)``, i.e. the padded layout with every sequence concatenated along the sequence axis (what a packed
  batch with ``position_ids`` looks like inside a Transformers attention layer). ``cu_seqlens_q``/``cu_seqlens_k``
  are int32 ``(num_seqs + 1,)`` cumulative lengths, as in flash-attn's varlen API; each sequence is attended
  separately, causality is bottom-right aligned within each sequence.
* The LSE returned by ``attn_fwd`` is fp32 ``(batch, heads, q_len)`` (``(1, heads, total_q)`` when packed), in
  natural-log units, ``+inf`` on rows that attend to nothing.
* With ``return_max``, ``attn_fwd`` also returns each row's largest pre-cap logit ``scaling * q.k`` over its
  allowed keys, fp32 in the LSE's layout, ``-inf`` on rows that attend to nothing (a kernel variant selected by a
  constexpr, so the ordinary kernel is unchanged); the ``..._with_max_logits`` entry points reduce it to one value
  per head.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch
import triton

from . import TMA_ENV, _tile_table, exact_tanh_requested, tma_requested  # noqa: F401 (TMA_ENV: the switch's name)
from ._attention_args import (  # noqa: F401 (MAX_HEAD_DIM: part of this module's interface)
    MAX_HEAD_DIM,
    _check_inputs,
    _empty_full,
    _last_contiguous,
    _mask_args,
    _scales,
    _strides3,
    _varlen_args,
)
from ._attention_bwd_kernels import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel, _attn_bwd_preprocess_kernel
from ._attention_kernels import _attn_fwd_kernel
from ._common import block_dim, dot_precision, is_interpreted, launch_context
from ._decode_kernels import _attn_combine_kernel, _attn_fwd_split_kernel

__all__ = ["attn_fwd", "attn_bwd"]


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and head_dim bucket, for 2-byte inputs: the fallback for
# any card or shape the frozen tile table (_tile_table.py) has no entry for. Chosen with
# `python scripts/compile_kernels.py` (no register spills, shared memory within sm_80/sm_86/sm_90 limits)
# and FlashAttention-2's shapes: the forward and dQ keep many query rows resident and stream keys; dK/dV keeps
# many keys resident and streams queries. Not tuned on hardware -- see docs/kernels.md.
_CONFIGS = {
    "fwd": {64: (128, 64, 8, 3), 128: (128, 64, 8, 3), 256: (64, 32, 4, 2)},
    "dkdv": {64: (32, 128, 8, 2), 128: (32, 64, 4, 2), 256: (16, 32, 4, 2)},
    "dq": {64: (128, 32, 8, 2), 128: (64, 32, 4, 2), 256: (32, 32, 4, 2)},
}
BWD_MODES = _tile_table.MODES


@functools.cache
def _cuda_arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


def _arch(device: torch.device, interpreted: bool) -> str:
    """The tile table's ``arch`` key: ``"interpreter"`` under ``TRITON_INTERPRET=1``, else ``"smNN"``."""
    if interpreted or device.type != "cuda":
        return "interpreter"
    return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())


def _entry(kernel: str, head_dim: int, dtype: torch.dtype, causal: bool, device: torch.device, interpreted: bool):
    return _tile_table.lookup(_arch(device, interpreted), kernel, head_dim, causal, str(dtype).removeprefix("torch."))


def _config(
    kernel: str, head_dim: int, dtype: torch.dtype, interpreted: bool, causal: bool, device: torch.device
) -> tuple[int, int, int, int]:
    """Tile sizes and launch options ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for ``kernel`` in ("fwd",
    "dkdv", "dq"): the tile table's entry for this card and shape, else the fallback below.

    Under the interpreter the cost is per tile, and 32x32 tiles keep CPU tests fast while still exercising the
    multi-block paths at the test lengths. fp32 tiles take twice the bytes: halve both sides and do not pipeline
    (fp32 is for exactness, not speed; this keeps every head_dim under sm_86's 99 KiB of shared memory)."""
    entry = _entry(kernel, head_dim, dtype, causal, device, interpreted)
    if entry is not None:
        return entry["block_m"], entry["block_n"], entry["num_warps"], entry["num_stages"]
    if interpreted:
        return 32, 32, 4, 1
    bucket = 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256
    bm, bn, warps, stages = _CONFIGS[kernel][bucket]
    if dtype == torch.float32:
        bm, bn, stages = max(bm // 2, 16), max(bn // 2, 16), 1
    return bm, bn, warps, stages


def _bwd_mode(head_dim: int, dtype: torch.dtype, causal: bool, device: torch.device, interpreted: bool) -> str:
    """How dQ is computed: the "dkdv" entry's ``mode`` where the table has one, else "separate"."""
    entry = _entry("dkdv", head_dim, dtype, causal, device, interpreted)
    return "separate" if entry is None else entry.get("mode", "separate")


@functools.cache
def _has_tanh_approx(device: torch.device) -> bool:
    """``tanh.approx.f32`` exists from compute capability 7.5 on, and only in NVIDIA's PTX (not on ROCm)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device) >= (7, 5)


def fast_tanh(dtype: torch.dtype, device: torch.device, interpreted: bool) -> bool:
    """The kernels' ``FAST_TANH`` flag: the cap's tanh from ``tanh.approx.f32`` for fp16/bf16 inputs on an NVIDIA
    GPU that has it, unless ``HF_QKNORM_EXACT_TANH`` asks for the exact one. Its error (about 2^-11 relative) is
    below fp16/bf16 rounding, not below fp32's: fp32 inputs, taken for exactness, keep the exact tanh. The
    interpreter cannot run inline assembly."""
    if interpreted or dtype not in (torch.float16, torch.bfloat16) or device.type != "cuda":
        return False
    return not exact_tanh_requested() and _has_tanh_approx(device)


@functools.cache
def _tma_supported_here() -> bool:
    """This Triton builds tensor descriptors in kernels (3.4+), and its launch-time scratch allocator is the
    context variable that ``_descriptor_scratch`` sets for one launch."""
    try:
        from triton.runtime import _allocation
    except ImportError:
        return False
    return hasattr(triton.language, "make_tensor_descriptor") and isinstance(
        getattr(_allocation, "_allocator", None), contextvars.ContextVar
    )


@functools.cache
def _has_tma(device: torch.device) -> bool:
    """TMA exists from compute capability 9.0 on (Hopper), in NVIDIA's GPUs only."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device) >= (9, 0)


def _tma(entry, q, k, v, varlen: bool, block_m: int, block_n: int, interpreted: bool) -> bool:
    """Whether the forward loads Q, K and V through tensor descriptors (``TMA``): asked for by the tile table's
    ``tma`` or by ``HF_QKNORM_TMA`` (which wins), and only where it applies -- a Hopper or later GPU (or the
    interpreter), head_dim a power of two from 16 to 256, tiles of at most 256 rows, each tensor's base address and
    batch, head and sequence strides multiples of 16 bytes. Elsewhere the pointer loads, silently."""
    asked = tma_requested()
    if asked is None:
        asked = bool(entry and entry.get("tma"))
    if not asked or not _tma_supported_here():
        return False
    if not interpreted and (q.device.type != "cuda" or not _has_tma(q.device)):
        return False
    d = q.shape[3]
    if d < 16 or d > 256 or d & (d - 1) or max(block_m, block_n) > _tile_table.TMA_MAX_BLOCK:
        return False
    for t in (q, k, v):
        if t.data_ptr() % 16 or any(s * t.element_size() % 16 for s in _strides3(t, varlen)):
            return False
    return True


@contextlib.contextmanager
def _descriptor_scratch(device: torch.device):
    """Kernels that build tensor descriptors need global scratch memory, which Triton asks its allocator for at
    launch. Set one for this launch only (a context variable: the caller's own allocator is put back after)."""
    from triton.runtime import _allocation

    token = _allocation._allocator.set(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))
    try:
        yield
    finally:
        _allocation._allocator.reset(token)


# The decoding-shaped forward (_decode_kernels.py) handles calls with at most this many (query, head) rows per
# KV head: decoding, speculative verification, short chunks against a long cache.
DECODE_MAX_ROWS = 64


def attn_fwd(
    q,
    k,
    v,
    *,
    scaling: float,
    softcap: float | None = None,
    causal: bool = True,
    attn_mask=None,
    sliding_window: int | None = None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    block_m: int | None = None,
    block_n: int | None = None,
    decode: bool | None = None,
    num_splits: int | None = None,
    return_max: bool = False,
):
    """Forward launcher. Returns ``(out, lse)``: ``out`` like ``q`` (contiguous, q's dtype), ``lse`` fp32
    ``q.shape[:3]``; with ``return_max``, ``(out, lse, row_max)`` (see the module docstring). ``block_m``/``block_n``
    override the tile sizes (tests use this to stress block edges). ``decode`` picks the GQA-packed split-KV forward
    (None: when ``q_len * heads / kv_heads <= 64`` and not packed); ``num_splits`` overrides its number of KV
    splits."""
    _check_inputs(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, scaling, softcap, sliding_window)
    q, k, v = (_last_contiguous(t) for t in (q, k, v))
    varlen, cu_q, cu_k, seqlen_q, seqlen_k, grid_q, _ = _varlen_args(
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k
    )
    # Packed rows past cu_seqlens_q[-1] belong to no sequence: zero them rather than leave garbage.
    out = (torch.zeros if varlen else torch.empty)(q.shape, dtype=q.dtype, device=q.device)
    lse = (torch.full if varlen else _empty_full)(q.shape[:3], float("inf"), dtype=torch.float32, device=q.device)
    row_max = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device) if return_max else None
    done = (out, lse) if not return_max else (out, lse, row_max)
    if out.numel() == 0 or grid_q == 0 or k.shape[2] == 0:
        out.zero_(), lse.fill_(float("inf"))
        return done
    mask, mask_strides = _mask_args(attn_mask, q, k)
    qk_scale, cap_log2 = _scales(scaling, softcap)
    if decode is None:
        decode = not varlen and block_m is None and q.shape[2] * (q.shape[1] // k.shape[1]) <= DECODE_MAX_ROWS
    if decode:
        if varlen:
            raise ValueError("the decoding forward does not take packed sequences")
        _decode_fwd(
            q, k, v, out, lse, row_max, attn_mask, qk_scale, cap_log2, causal, softcap, sliding_window, num_splits
        )
        return done
    interpreted = is_interpreted(_attn_fwd_kernel)
    bm, bn, warps, stages = _config("fwd", q.shape[3], q.dtype, interpreted, causal, q.device)
    bm, bn = block_m or bm, block_n or bn
    entry = _entry("fwd", q.shape[3], q.dtype, causal, q.device, interpreted)
    tma = _tma(entry, q, k, v, varlen, bm, bn, interpreted)
    batch = len(cu_q) - 1 if varlen else q.shape[0]
    grid = (triton.cdiv(grid_q, bm), batch * q.shape[1])
    scratch = _descriptor_scratch(q.device) if tma else contextlib.nullcontext()
    with launch_context(q.device), scratch:
        _attn_fwd_kernel[grid](
            q,
            k,
            v,
            out,
            lse,
            lse if row_max is None else row_max,
            mask,
            cu_q,
            cu_k,
            *_strides3(q, varlen),
            *_strides3(k, varlen),
            *_strides3(v, varlen),
            *_strides3(out, varlen),
            0 if varlen else lse.stride(0),
            lse.stride(1),
            *mask_strides,
            q.shape[1],
            q.shape[1] // k.shape[1],
            seqlen_q,
            seqlen_k,
            qk_scale,
            cap_log2,
            sliding_window or 0,
            HEAD_DIM=q.shape[3],
            BLOCK_D=block_dim(q.shape[3]),
            BLOCK_M=bm,
            BLOCK_N=bn,
            IS_CAUSAL=causal,
            HAS_CAP=softcap is not None,
            HAS_WINDOW=sliding_window is not None,
            HAS_MASK=attn_mask is not None,
            VARLEN=varlen,
            DOT_PRECISION=dot_precision(q.dtype),
            RETURN_MAX=return_max,
            FAST_TANH=fast_tanh(q.dtype, q.device, interpreted),
            TMA=tma,
            num_warps=warps,
            num_stages=stages,
        )
    return done


def _auto_splits(programs: int, kv_len: int, block_n: int, device: torch.device, interpreted: bool) -> int:
    """Enough KV splits to give the GPU ~2 waves of programs, but at least 4 key blocks per split (below that the
    combine costs more than the parallelism brings)."""
    most = max(1, triton.cdiv(kv_len, 4 * block_n))
    if interpreted:  # CPU tests: split whenever there is more than one key block, to exercise the combine
        return min(4, triton.cdiv(kv_len, block_n))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(2 * sms, programs), most, 128))


def _decode_fwd(q, k, v, out, lse, row_max, attn_mask, qk_scale, cap_log2, causal, softcap, sliding_window, num_splits):
    """GQA-packed split-KV forward into ``out``/``lse`` (and ``row_max`` unless None; see _decode_kernels.py)."""
    mask, mask_strides = _mask_args(attn_mask, q, k)
    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    interpreted = is_interpreted(_attn_fwd_split_kernel)
    bm = min(DECODE_MAX_ROWS, max(16, triton.next_power_of_2(q_len * groups)))
    entry = _entry("decode", head_dim, q.dtype, causal, q.device, interpreted)
    if entry is not None:
        bn, warps, stages = entry["block_n"], entry["num_warps"], entry["num_stages"]
    elif interpreted:
        bn, warps, stages = 32, 4, 1
    elif q.dtype == torch.float32:
        bn, warps, stages = 32 if head_dim <= 128 else 16, 4, 1
    else:
        bn, warps, stages = (64, 4, 3) if head_dim <= 128 else (32, 4, 2)
    m_blocks = triton.cdiv(q_len * groups, bm)
    if num_splits is None:
        num_splits = _auto_splits(batch * kv_heads * m_blocks, kv_len, bn, q.device, interpreted)
    split_len = triton.cdiv(triton.cdiv(kv_len, num_splits), bn) * bn
    num_splits = triton.cdiv(kv_len, split_len)  # no empty trailing split
    o_part = torch.empty((num_splits, batch, heads, q_len, head_dim), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((num_splits, batch, heads, q_len), dtype=torch.float32, device=q.device)
    max_part = torch.empty_like(lse_part) if row_max is not None else lse_part
    with launch_context(q.device):
        _attn_fwd_split_kernel[(num_splits, batch * kv_heads, m_blocks)](
            q,
            k,
            v,
            o_part,
            lse_part,
            max_part,
            mask,
            *q.stride()[:3],
            *k.stride()[:3],
            *v.stride()[:3],
            *mask_strides,
            batch,
            heads,
            kv_heads,
            groups,
            q_len,
            kv_len,
            split_len,
            qk_scale,
            cap_log2,
            sliding_window or 0,
            HEAD_DIM=head_dim,
            BLOCK_D=block_dim(head_dim),
            BLOCK_M=bm,
            BLOCK_N=bn,
            IS_CAUSAL=causal,
            HAS_CAP=softcap is not None,
            HAS_WINDOW=sliding_window is not None,
            HAS_MASK=attn_mask is not None,
            DOT_PRECISION=dot_precision(q.dtype),
            RETURN_MAX=row_max is not None,
            FAST_TANH=fast_tanh(q.dtype, q.device, interpreted),
            num_warps=warps,
            num_stages=stages,
        )
        cm = min(64, max(16, triton.next_power_of_2(q_len)))
        _attn_combine_kernel[(triton.cdiv(q_len, cm), batch * heads)](
            o_part,
            lse_part,
            out,
            lse,
            *out.stride()[:3],
            num_splits,
            batch * heads * q_len,
            heads,
            q_len,
            HEAD_DIM=head_dim,
            BLOCK_D=block_dim(head_dim),
            BLOCK_M=cm,
        )
    if row_max is not None:
        torch.amax(max_part, dim=0, out=row_max)


def attn_bwd(
    dout,
    q,
    k,
    v,
    out,
    lse,
    *,
    scaling: float,
    softcap: float | None = None,
    causal: bool = True,
    attn_mask=None,
    sliding_window: int | None = None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    dlse=None,
    block_m: int | None = None,
    block_n: int | None = None,
    mode: str | None = None,
):
    """Backward launcher: ``(dq, dk, dv)``, contiguous, in the inputs' dtype. ``out``/``lse`` come from
    :func:`attn_fwd` with the same arguments; ``dlse`` (optional) is a gradient flowing into the LSE output.
    ``mode`` overrides the tile table's way of computing dQ: "separate" (its own pass) or "atomic" (fp32 atomic
    adds from the dK/dV program)."""
    if mode is not None and mode not in BWD_MODES:
        raise ValueError(f"attn_bwd: mode={mode!r} is not one of {BWD_MODES}")
    _check_inputs(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, scaling, softcap, sliding_window)
    if dout.shape != q.shape or out.shape != q.shape or lse.shape != q.shape[:3]:
        raise ValueError(
            f"dout {tuple(dout.shape)}, out {tuple(out.shape)}, lse {tuple(lse.shape)} do not match q {tuple(q.shape)}"
        )
    q, k, v, out, dout = (_last_contiguous(t) for t in (q, k, v, out, dout))
    lse = lse.contiguous()
    varlen, cu_q, cu_k, seqlen_q, seqlen_k, grid_q, grid_k = _varlen_args(
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k
    )
    # Every row of a padded batch is written by the kernels; packed rows past cu_seqlens[-1] are not.
    alloc = torch.zeros if varlen else torch.empty
    dq, dk, dv = (alloc(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    if q.numel() == 0 or k.numel() == 0 or grid_q == 0 or grid_k == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    interpreted = is_interpreted(_attn_fwd_kernel)
    head_dim, heads, kv_heads = q.shape[3], q.shape[1], k.shape[1]
    atomic = (mode or _bwd_mode(head_dim, q.dtype, causal, q.device, interpreted)) == "atomic"
    # Atomic mode accumulates into fp32 (zeroed: every program adds into it), cast once at the end.
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if atomic else dq
    bd = block_dim(head_dim)
    mask, mask_strides = _mask_args(attn_mask, q, k)
    qk_scale, cap_log2 = _scales(scaling, softcap)
    batch = len(cu_q) - 1 if varlen else q.shape[0]
    delta = torch.empty_like(lse)
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()
    flags = dict(
        HEAD_DIM=head_dim,
        BLOCK_D=bd,
        IS_CAUSAL=causal,
        HAS_CAP=softcap is not None,
        HAS_WINDOW=sliding_window is not None,
        HAS_MASK=attn_mask is not None,
        VARLEN=varlen,
        DOT_PRECISION=dot_precision(q.dtype),
        FAST_TANH=fast_tanh(q.dtype, q.device, interpreted),
    )
    lse_strides = (0 if varlen else lse.stride(0), lse.stride(1))
    scalars = (q.shape[1] // k.shape[1], seqlen_q, seqlen_k, qk_scale, cap_log2, scaling, sliding_window or 0)
    with launch_context(q.device):
        pre_m = 32 if interpreted else max(16, 8192 // bd)
        _attn_bwd_preprocess_kernel[(triton.cdiv(q.shape[2], pre_m), q.shape[0] * heads)](
            out,
            dout,
            dlse if dlse is not None else lse,
            delta,
            *out.stride()[:3],
            *dout.stride()[:3],
            heads,
            q.shape[2],
            HEAD_DIM=head_dim,
            BLOCK_D=bd,
            BLOCK_M=pre_m,
            HAS_DLSE=dlse is not None,
        )
        # dK/dV: BLOCK_N keys resident, query blocks of every head in the GQA group streamed.
        bm, bn, warps, stages = _config("dkdv", head_dim, q.dtype, interpreted, causal, q.device)
        bm, bn = block_m or bm, block_n or bn
        _attn_bwd_dkdv_kernel[(triton.cdiv(grid_k, bn), batch * kv_heads)](
            q,
            k,
            v,
            dout,
            lse,
            delta,
            dk,
            dv,
            dq_acc,
            mask,
            cu_q,
            cu_k,
            *_strides3(q, varlen),
            *_strides3(k, varlen),
            *_strides3(v, varlen),
            *_strides3(dout, varlen),
            *_strides3(dk, varlen),
            *_strides3(dv, varlen),
            *_strides3(dq_acc, varlen),
            *lse_strides,
            *mask_strides,
            kv_heads,
            *scalars,
            BLOCK_M=bm,
            BLOCK_N=bn,
            ATOMIC_DQ=atomic,
            num_warps=warps,
            num_stages=stages,
            **flags,
        )
        if atomic:
            dq.copy_(dq_acc)
            return dq, dk, dv
        # dQ: BLOCK_M queries resident, key blocks streamed (the forward's loop).
        bm, bn, warps, stages = _config("dq", head_dim, q.dtype, interpreted, causal, q.device)
        bm, bn = block_m or bm, block_n or bn
        _attn_bwd_dq_kernel[(triton.cdiv(grid_q, bm), batch * heads)](
            q,
            k,
            v,
            dout,
            lse,
            delta,
            dq,
            mask,
            cu_q,
            cu_k,
            *_strides3(q, varlen),
            *_strides3(k, varlen),
            *_strides3(v, varlen),
            *_strides3(dout, varlen),
            *_strides3(dq, varlen),
            *lse_strides,
            *mask_strides,
            heads,
            *scalars,
            BLOCK_M=bm,
            BLOCK_N=bn,
            num_warps=warps,
            num_stages=stages,
            **flags,
        )
    return dq, dk, dv


# --------------------------------------------------------------------------------------------------------------
# torch.library custom ops: opaque to torch.compile / AOTAutograd, with fake (meta) kernels for tracing and an
# autograd formula that calls the backward op. Schemas are spelled out so that nothing depends on annotations.
# --------------------------------------------------------------------------------------------------------------

_ARGS = (
    "Tensor? attn_mask, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, "
    "float scaling, float? softcap, bool causal, SymInt? sliding_window"
)


def _launcher_kwargs(
    attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scaling, softcap, causal, sliding_window
) -> dict:
    return dict(
        attn_mask=attn_mask,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        scaling=scaling,
        softcap=softcap,
        causal=causal,
        sliding_window=sliding_window,
    )


# The forward ops also take the forward's path: ``decode`` None picks by shape (see attn_fwd), True/False forces it;
# ``num_splits`` overrides the decoding forward's KV splits. The backward does not depend on either.
_FWD_ARGS = f"{_ARGS}, bool? decode=None, SymInt? num_splits=None"


@torch.library.custom_op(
    "hf_qknorm::attn_fwd", mutates_args=(), schema=f"(Tensor q, Tensor k, Tensor v, {_FWD_ARGS}) -> (Tensor, Tensor)"
)
def _attn_fwd_op(
    q,
    k,
    v,
    attn_mask,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    scaling,
    softcap,
    causal,
    sliding_window,
    decode=None,
    num_splits=None,
):
    return attn_fwd(
        q,
        k,
        v,
        decode=decode,
        num_splits=num_splits,
        **_launcher_kwargs(
            attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scaling, softcap, causal, sliding_window
        ),
    )


@_attn_fwd_op.register_fake
def _attn_fwd_fake(q, k, v, *args):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op(
    "hf_qknorm::attn_fwd_max",
    mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, {_FWD_ARGS}) -> (Tensor, Tensor, Tensor)",
)
def _attn_fwd_max_op(
    q,
    k,
    v,
    attn_mask,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    scaling,
    softcap,
    causal,
    sliding_window,
    decode=None,
    num_splits=None,
):
    """``attn_fwd`` that also returns each row's largest pre-cap logit (the ``RETURN_MAX`` kernel variant)."""
    return attn_fwd(
        q,
        k,
        v,
        return_max=True,
        decode=decode,
        num_splits=num_splits,
        **_launcher_kwargs(
            attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scaling, softcap, causal, sliding_window
        ),
    )


@_attn_fwd_max_op.register_fake
def _attn_fwd_max_fake(q, k, v, *args):
    return (
        q.new_empty(q.shape),
        q.new_empty(q.shape[:3], dtype=torch.float32),
        q.new_empty(q.shape[:3], dtype=torch.float32),
    )


@torch.library.custom_op(
    "hf_qknorm::attn_bwd",
    mutates_args=(),
    schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, "
    f"{_ARGS}) -> (Tensor, Tensor, Tensor)",
)
def _attn_bwd_op(
    dout,
    q,
    k,
    v,
    out,
    lse,
    dlse,
    attn_mask,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    scaling,
    softcap,
    causal,
    sliding_window,
):
    return attn_bwd(
        dout,
        q,
        k,
        v,
        out,
        lse,
        dlse=dlse,
        **_launcher_kwargs(
            attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scaling, softcap, causal, sliding_window
        ),
    )


@_attn_bwd_op.register_fake
def _attn_bwd_fake(dout, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _attn_setup_context(ctx, inputs, output):
    q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, *params = inputs
    out, lse = output[:2]  # attn_fwd_max's row maxima take no gradient
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, cu_seqlens_q, cu_seqlens_k)
    ctx.params = params[:6]  # max_seqlen_q, max_seqlen_k, scaling, softcap, causal, sliding_window (not the path)


def _attn_backward(ctx, dout, dlse, *_):
    q, k, v, out, lse, attn_mask, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.hf_qknorm.attn_bwd(
        dout, q, k, v, out, lse, dlse, attn_mask, cu_seqlens_q, cu_seqlens_k, *ctx.params
    )
    return (dq, dk, dv) + (None,) * 11  # attn_mask .. num_splits take no gradient


torch.library.register_autograd("hf_qknorm::attn_fwd", _attn_backward, setup_context=_attn_setup_context)
torch.library.register_autograd("hf_qknorm::attn_fwd_max", _attn_backward, setup_context=_attn_setup_context)

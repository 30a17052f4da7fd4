"""Argument checking and preparation for the attention launchers (:mod:`.attention`): shapes, dtypes, masks,
packed sequences, strides and the scales the kernels take."""

from __future__ import annotations

import math

import torch

from ._attention_kernels import _attn_fwd_kernel
from ._common import SUPPORTED_DTYPES, check_device

MAX_HEAD_DIM = 256
LOG2E = math.log2(math.e)


def _check_inputs(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, scaling, softcap, sliding_window):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_device(_attn_fwd_kernel, q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, what="q, k, v and masks")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    batch, heads, _, head_dim = q.shape
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k/v {tuple(k.shape)} do not match q {tuple(q.shape)} in batch or head_dim")
    if heads % k.shape[1] != 0:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({k.shape[1]})")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if not math.isfinite(scaling):
        raise ValueError(f"scaling must be a finite float, got {scaling}")
    if softcap is not None and not (softcap > 0 and math.isfinite(softcap)):
        raise ValueError(f"softcap must be a positive float or None, got {softcap}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("pass both cu_seqlens_q and cu_seqlens_k, or neither")
    if cu_seqlens_q is not None:
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if cu.dtype != torch.int32 or cu.dim() != 1:
                raise ValueError(f"{name} must be a 1-D int32 tensor, got {cu.dtype} of shape {tuple(cu.shape)}")
        if cu_seqlens_q.shape != cu_seqlens_k.shape:
            raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length (num_seqs + 1)")
        if batch != 1:
            raise ValueError(f"with cu_seqlens, q/k/v must be packed as (1, heads, total, head_dim), got batch {batch}")
        if attn_mask is not None:
            raise ValueError("attn_mask cannot be combined with cu_seqlens: the packing already defines the mask")
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool:
            raise TypeError(
                f"attn_mask must be boolean (True = attend), got {attn_mask.dtype}; convert an additive "
                "mask with `mask == 0` if it only holds 0 and -inf"
            )
        want = (batch, heads, q.shape[2], k.shape[2])
        if attn_mask.dim() != 4 or any(m not in (1, w) for m, w in zip(attn_mask.shape, want)):
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (batch, 1 or "
                f"heads, q_len, kv_len) = {want}"
            )


def _mask_args(attn_mask, q, k):
    """A uint8 view of the mask broadcast to (batch, heads, q_len, kv_len) -- stride 0 on broadcast dims, no copy
    -- and its four strides. Without a mask, a dummy pointer and zero strides."""
    if attn_mask is None:
        return q, (0, 0, 0, 0)
    m = attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return m.view(torch.uint8), m.stride()


def _varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k):
    """(VARLEN, cu_q, cu_k, seqlen_q, seqlen_k, grid length_q, grid length_k)."""
    if cu_seqlens_q is None:
        return False, q, q, q.shape[2], k.shape[2], q.shape[2], k.shape[2]
    if max_seqlen_q is None:  # costs a device sync; pass it when you know it
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_seqlen_k is None:
        max_seqlen_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max())
    return True, cu_seqlens_q, cu_seqlens_k, q.shape[2], k.shape[2], int(max_seqlen_q), int(max_seqlen_k)


def _scales(scaling: float, softcap: float | None) -> tuple[float, float]:
    if softcap is None:
        return scaling * LOG2E, 1.0
    return scaling / softcap, softcap * LOG2E


def _strides3(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, head, seq) strides; batch stride 0 when packed, so kernels index batch = sequence id safely."""
    return (0 if varlen else t.stride(0)), t.stride(1), t.stride(2)


def _empty_full(shape, fill_value, **kwargs) -> torch.Tensor:
    """``torch.full``'s signature, ``torch.empty``'s cost: for outputs that the kernel writes entirely."""
    return torch.empty(shape, **kwargs)


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()

"""The public entry points of the capped flash attention: one per calling shape, each with one return type.

After flash-attention's ``flash_attn_interface.py`` (``flash_attn_func``, ``flash_attn_varlen_func``,
``flash_attn_with_kvcache``):

* :func:`qknorm_attn_func` -- padded batches, ``(batch, heads, seq, head_dim)``; picks the decoding forward by
  itself for decoding-shaped calls.
* :func:`qknorm_attn_varlen_func` -- packed sequences described by ``cu_seqlens``.
* :func:`qknorm_attn_with_kvcache` -- new queries against a KV cache, always on the decoding forward.
* :func:`qknorm_attn_func_with_max_logits`, :func:`qknorm_attn_varlen_func_with_max_logits` -- the same calls,
  returning :class:`AttnOutputWithMaxLogits`: the output and the per-head largest pre-cap logit (QK-Clip and the
  monitor's telemetry), taken from the kernel's own pass.

Every function computes ``softmax(mask(c * tanh(scaling * q k^T / c))) v`` -- the cap ``c`` applied to the logits
before the mask, as in Gemma 2 -- in fused, differentiable kernels (the ``torch.library`` custom ops of
:mod:`.attention`, so ``torch.compile(fullgraph=True)`` traces each call as one node). Where the norm sits: the
kernels see ``q`` and ``k`` as the attention layer hands them over, i.e. after the per-head norm and after RoPE.

Common arguments:
    scaling: multiplies ``q.k``; ``None`` is ``head_dim ** -0.5`` (pass 1.0 for an ``lp`` norm's learnt scale).
    softcap: ``c`` in ``c * tanh(s / c)``, a positive float, applied before the mask; ``None`` for no cap.
    causal: bottom-right aligned: query ``i`` sits at position ``i + kv_len - q_len`` (right for a KV cache whose
        last ``q_len`` entries are the queries' own keys).
    sliding_window: keep keys with ``pos_q - pos_k < sliding_window``; ``None`` for no window.
    q, k, v dtypes: float16, bfloat16 or float32, one dtype for all three. ``heads % kv_heads == 0`` (GQA: query head
    ``h`` reads K/V head ``h // (heads // kv_heads)``, K/V are never repeated in memory); ``head_dim <= 256`` (80 and
    96 are padded inside the kernel). Strided inputs with a contiguous last dimension are read in place.
Outputs are contiguous, in q's dtype; a row that may attend to no key is 0. There is no attention dropout.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import attention as _attention  # noqa: F401 (registers the torch.ops.hf_qknorm custom ops)
from ._attention_args import _check_inputs, _varlen_args

__all__ = [
    "AttnOutputWithMaxLogits",
    "qknorm_attn_func",
    "qknorm_attn_func_with_max_logits",
    "qknorm_attn_varlen_func",
    "qknorm_attn_varlen_func_with_max_logits",
    "qknorm_attn_with_kvcache",
]


class AttnOutputWithMaxLogits(NamedTuple):
    """What the ``..._with_max_logits`` entry points return.

    Attributes:
        out: the attention output, exactly what the plain entry point returns (differentiable).
        max_logits: ``(heads,)`` float32, the largest pre-cap logit ``scaling * q.k`` of each query head over the
            batch (or all packed sequences) and the pairs the mask allows; ``-inf`` for a head with no allowed pair.
            The kernel's own row maxima, reduced; detached (no gradient).
    """

    out: torch.Tensor
    max_logits: torch.Tensor


def _run(
    q,
    k,
    v,
    *,
    scaling,
    softcap,
    causal,
    attn_mask=None,
    sliding_window=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    decode=None,
    num_splits=None,
    with_max: bool = False,
):
    """The custom op call behind every entry point: ``out``, or ``(out, (heads,) max logits)`` with ``with_max``."""
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    _check_inputs(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, scaling, softcap, sliding_window)
    if cu_seqlens_q is not None:
        *_, max_seqlen_q, max_seqlen_k = _varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k)
    else:
        max_seqlen_q, max_seqlen_k = q.shape[2], k.shape[2]
    op = torch.ops.hf_qknorm.attn_fwd_max if with_max else torch.ops.hf_qknorm.attn_fwd
    out, _, *row_max = op(
        q,
        k,
        v,
        attn_mask,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        float(scaling),
        None if softcap is None else float(softcap),
        bool(causal),
        sliding_window,
        decode,
        num_splits,
    )
    if not with_max:
        return out
    return out, row_max[0].detach().amax(dim=(0, 2))


def qknorm_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
    causal: bool = True,
    attn_mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Capped attention over a padded batch: ``q`` ``(batch, heads, q_len, head_dim)``, ``k``/``v`` ``(batch,
    kv_heads, kv_len, head_dim)``, an optional boolean ``attn_mask`` (True = attend) broadcastable to ``(batch, 1 or
    heads, q_len, kv_len)`` and intersected with ``causal`` and ``sliding_window``; returns ``(batch, heads, q_len,
    head_dim)`` in q's dtype, contiguous (the common arguments: the module docstring). Calls of at most 64 ``(query,
    head)`` rows per KV head run the GQA-packed split-KV forward, the rest the general one: the same output and LSE,
    one backward."""
    return _run(
        q, k, v, scaling=scaling, softcap=softcap, causal=causal, attn_mask=attn_mask, sliding_window=sliding_window
    )


def qknorm_attn_func_with_max_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
    causal: bool = True,
    attn_mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> AttnOutputWithMaxLogits:
    """:func:`qknorm_attn_func` that also returns the per-head largest pre-cap logit
    (:class:`AttnOutputWithMaxLogits`), from the kernel's ``RETURN_MAX`` variant -- no second pass over q and k."""
    return AttnOutputWithMaxLogits(
        *_run(
            q,
            k,
            v,
            scaling=scaling,
            softcap=softcap,
            causal=causal,
            attn_mask=attn_mask,
            sliding_window=sliding_window,
            with_max=True,
        )
    )


def qknorm_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Capped attention over packed sequences, each attended separately (flash-attn's varlen convention): ``q`` ``(1,
    heads, total_q, head_dim)`` and ``k``/``v`` ``(1, kv_heads, total_k, head_dim)`` with the sequences concatenated,
    ``cu_seqlens_q/k`` int32 ``(num_seqs + 1,)`` cumulative lengths on q's device; returns ``(1, heads, total_q,
    head_dim)`` in q's dtype, contiguous. Rows past ``cu_seqlens_q[-1]`` get output and gradient 0; ``causal`` is
    bottom-right per sequence. ``max_seqlen_q/k`` of ``None`` are computed from ``cu_seqlens``: a device sync, and a
    graph break under ``torch.compile`` (pass them there)."""
    return _run(
        q,
        k,
        v,
        scaling=scaling,
        softcap=softcap,
        causal=causal,
        sliding_window=sliding_window,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
    )


def qknorm_attn_varlen_func_with_max_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
) -> AttnOutputWithMaxLogits:
    """:func:`qknorm_attn_varlen_func` that also returns the per-head largest pre-cap logit over all packed
    sequences (:class:`AttnOutputWithMaxLogits`)."""
    return AttnOutputWithMaxLogits(
        *_run(
            q,
            k,
            v,
            scaling=scaling,
            softcap=softcap,
            causal=causal,
            sliding_window=sliding_window,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            with_max=True,
        )
    )


def qknorm_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
    causal: bool = True,
    attn_mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Capped attention of a few new queries ``q`` ``(batch, heads, q_len, head_dim)`` against a dense cache
    ``k_cache``/``v_cache`` ``(batch, kv_heads, kv_len, head_dim)`` already holding their keys and values as its
    last ``q_len`` entries, on the decoding forward (a KV group's query heads in one tile, the keys split into
    ``num_splits`` chunks, merged exactly); returns ``(batch, heads, q_len, head_dim)`` in q's dtype, differentiable.
    With ``causal`` query ``i`` sits at ``kv_len - q_len + i``: for a static cache pass the filled prefix, or
    ``causal=False`` with an ``attn_mask`` holding causality and the filled slots. No ``cache_seqlens`` nor in-place
    append (flash-attn has both)."""
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None (automatic), got {num_splits!r}")
    return _run(
        q,
        k_cache,
        v_cache,
        scaling=scaling,
        softcap=softcap,
        causal=causal,
        attn_mask=attn_mask,
        sliding_window=sliding_window,
        decode=True,
        num_splits=num_splits,
    )

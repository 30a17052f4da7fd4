"""The one mask rule of the ``"qknorm"`` backend (and of the exported remote code).

Transformers hands an attention function either a mask or ``None``. The ``"qknorm"`` implementation registers
Transformers' ``sdpa_mask`` as its mask function, so both mean what they mean for ``sdpa``:

- a boolean ``(batch|1, 1|heads, q_len, kv_len)`` mask (True = attend), or an additive float mask of 0 and -inf
  (or the dtype's minimum), already holds causality, padding, packing and any sliding window;
- ``None`` means a plain causal pattern aligned **top-left** (query ``i`` sees keys ``0..i``), as sdpa's
  ``is_causal``: Transformers only omits the mask when that is exact -- no padding and ``q_len == kv_len``, a
  single query (which then sees every key), or a prefill into an empty static cache whose unused slots lie beyond
  the diagonal. With a single query, or ``is_causal=False``, nothing is masked.

This module imports nothing but ``torch``: it is also copied into exported folders.
"""

from __future__ import annotations

import torch


def check_attention_args(query, key, mask, scaling, dropout, sliding_window) -> None:
    """Refuse, naming the value, what an attention function could only compute wrongly: a mask that does not fit
    (:func:`check_mask`); a scaling that is not finite (every logit NaN); a dropout outside ``[0, 1)``; a sliding
    window below 1 (no key at all)."""
    check_mask(query, key, mask)
    check_scalars(scaling, dropout, sliding_window)


def check_mask(query, key, mask) -> None:
    """Refuse a mask that is not ``(batch|1, 1|heads, q_len|1, kv_len)`` for these ``query``/``key`` (sdpa refuses
    one too; slicing or broadcasting a longer or other-batch mask would silently attend by the wrong entries), or of
    an integer dtype."""
    if mask is not None:
        batch, heads, q_len, kv_len = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
        shape = tuple(mask.shape)
        if (
            mask.dim() != 4
            or shape[0] not in (1, batch)
            or shape[1] not in (1, heads)
            or shape[2] not in (1, q_len)
            or shape[3] != kv_len
        ):
            raise ValueError(
                f"attention mask of shape {shape} does not fit query {tuple(query.shape)} and key "
                f"{tuple(key.shape)}: expected (batch|1, 1|heads, q_len|1, kv_len) = "
                f"({batch}|1, 1|{heads}, {q_len}|1, {kv_len})"
            )
        if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
            raise ValueError(
                f"attention mask of dtype {mask.dtype}: expected torch.bool (True = attend) or an "
                "additive floating-point mask of 0 and -inf"
            )


def check_scalars(scaling, dropout, sliding_window) -> None:
    """Refuse a scaling that is not a finite number, a dropout outside ``[0, 1)``, a sliding window below 1."""
    if (
        not isinstance(scaling, (int, float))
        or isinstance(scaling, bool)
        or not scaling == scaling
        or scaling in (float("inf"), float("-inf"))
    ):
        raise ValueError(f"attention scaling must be a finite number, got {scaling!r}")
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"attention dropout must be a probability in [0, 1), got {dropout!r}")
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be a positive number of positions (or None), got {sliding_window!r}")


def bool_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Boolean (True = attend) view of an attention mask; float masks must be 0 / -inf (or dtype-min) only."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    if not mask.dtype.is_floating_point:
        raise ValueError(
            f"attention mask of dtype {mask.dtype}: expected torch.bool (True = attend) or an "
            "additive floating-point mask of 0 and -inf"
        )
    blocked = mask <= torch.finfo(mask.dtype).min / 2
    if not bool(torch.all(blocked | (mask == 0))):
        raise ValueError(
            "qknorm attention takes boolean masks or additive masks of 0 and -inf only; got an additive "
            "mask with other values (a position bias?). Use attn_implementation='eager' for such masks."
        )
    return ~blocked


def implicit_causal(q_len: int, kv_len: int, device=None) -> torch.Tensor:
    """The ``(q_len, kv_len)`` pattern a missing mask stands for: top-left causal, ``key <= query``."""
    return torch.arange(kv_len, device=device)[None, :] <= torch.arange(q_len, device=device)[:, None]


def resolve_mask(mask: torch.Tensor | None, q_len: int, kv_len: int, causal: bool):
    """The rule, as ``(mask, causal, keys)``: which pairs an attention call allows, for every consumer of it (the
    backend's paths, the telemetry, calibration's statistics).

    - a mask (boolean or additive): complete -- ``(boolean mask, False, kv_len)``;
    - no mask, ``causal`` and several queries: top-left causal, so keys past the last query row are never seen --
      ``(None, True, min(kv_len, q_len))``, and over the first ``keys`` keys ``causal`` is the square pattern
      (equivalently bottom-right aligned);
    - otherwise everything is allowed -- ``(None, False, kv_len)``."""
    mask = bool_mask(mask)
    if mask is not None:
        return mask, False, kv_len
    if causal and q_len > 1:
        return None, True, min(kv_len, q_len)
    return None, False, kv_len


def allowed_pairs(mask: torch.Tensor | None, q_len: int, kv_len: int, causal: bool, device=None):
    """Boolean broadcastable ``(.., q_len, kv_len)`` of allowed pairs (:func:`resolve_mask`), or ``None`` when
    everything is allowed."""
    mask, causal, _ = resolve_mask(mask, q_len, kv_len, causal)
    if causal:
        return implicit_causal(q_len, kv_len, device)[None, None]
    return mask


# (key, position_ids, whether they restart), key = the tensor's identity and version: every layer of a forward gets the
# same tensor, so the host sync that answers it happens once per forward, not once per layer. One immutable entry,
# read once and replaced whole: a thread beside another sees either's whole entry, never one's key with the other's
# answer (no lock on the hot path: one reference read, one reference write).
_RESTART_CACHE: tuple = (None, None, False)


def _restarts(position_ids: torch.Tensor) -> torch.Tensor:
    return position_ids[..., 1:] != position_ids[..., :-1] + 1


def packed_sequence_mask(
    position_ids: torch.Tensor | None, q_len: int, kv_len: int, mask: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The block-diagonal causal ``(batch, 1, q_len, kv_len)`` mask of sequences packed into a row, recognised where
    ``position_ids`` restart (``DataCollatorWithFlattening``), or ``None`` when they do not.

    Transformers builds this mask itself only without a cache; with ``use_cache`` on (a ``Trainer`` run's default
    config) it leaves the packing out -- no mask, or a plain sliding-window mask -- and plain sdpa then lets the
    sequences attend to each other. Keys beyond the queries are a static cache's empty slots when the boolean
    ``mask`` (if any) lets no query see them (a prefill); otherwise the cache holds tokens, and which of them belong
    to which packed sequence cannot be known: refused. Under ``torch.compile`` (no data-dependent checks) the mask is
    built whenever keys and queries match, and left to Transformers otherwise."""
    global _RESTART_CACHE
    if position_ids is None or position_ids.dim() != 2 or q_len < 2 or position_ids.shape[-1] != q_len:
        return None  # (rows, batch, seq) multimodal RoPE positions: Transformers reads no packing from them either
    compiling = torch.compiler.is_compiling()
    if not compiling:  # eager: skip all of this when nothing restarts (one sync per forward)
        key = (id(position_ids), position_ids._version)
        cached_key, cached_ids, restarts = _RESTART_CACHE  # the one read: checked and used from here
        if cached_ids is not position_ids or cached_key != key:
            restarts = bool(_restarts(position_ids).any())
            _RESTART_CACHE = (key, position_ids, restarts)
        if not restarts:
            return None
        if kv_len != q_len and mask is not None and bool(mask[..., q_len:].any()):
            raise ValueError(
                f"packed sequences (position_ids restart within a row) appended to a cache that holds "
                f"{kv_len - q_len} earlier tokens: hf_qknorm cannot tell which cached keys belong to "
                "which sequence; run packed batches with use_cache=False"
            )
    elif kv_len != q_len:
        return None
    seq = torch.nn.functional.pad(_restarts(position_ids).long().cumsum(-1), (1, 0))  # (B, T) sequence index
    same = (seq[:, :, None] == seq[:, None, :]) & implicit_causal(q_len, q_len, position_ids.device)
    return torch.nn.functional.pad(same, (0, kv_len - q_len))[:, None]  # a static cache's empty slots: never seen

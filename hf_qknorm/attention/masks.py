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


def bool_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Boolean (True = attend) view of an attention mask; float masks must be 0 / -inf (or dtype-min) only."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    blocked = mask <= torch.finfo(mask.dtype).min / 2
    if not bool(torch.all(blocked | (mask == 0))):
        raise ValueError("qknorm attention takes boolean masks or additive masks of 0 and -inf only; got an additive "
                         "mask with other values (a position bias?). Use attn_implementation='eager' for such masks.")
    return ~blocked


def implicit_causal(q_len: int, kv_len: int, device=None) -> torch.Tensor:
    """The ``(q_len, kv_len)`` pattern a missing mask stands for: top-left causal, ``key <= query``."""
    return torch.arange(kv_len, device=device)[None, :] <= torch.arange(q_len, device=device)[:, None]


def allowed_pairs(mask: torch.Tensor | None, q_len: int, kv_len: int, causal: bool, device=None):
    """Boolean broadcastable ``(.., q_len, kv_len)`` of allowed pairs, or ``None`` when everything is allowed:
    the given mask as it is, or -- without one -- the implicit causal pattern (``causal`` and ``q_len > 1``)."""
    mask = bool_mask(mask)
    if mask is not None:
        return mask
    if causal and q_len > 1:
        return implicit_causal(q_len, kv_len, device)[None, None]
    return None

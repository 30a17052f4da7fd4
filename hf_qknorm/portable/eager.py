"""Capped attention that materialises the ``(q_len, kv_len)`` logits and returns the attention weights.

The simple, exact form of the ``"qknorm"`` backend: the attention function of exported folders loaded without the
plugin (``trust_remote_code``), and the path that returns attention weights when a caller asks for them. Memory is
quadratic in sequence length; the plugin's backend is the efficient way to train.

This module imports nothing but ``torch`` and :mod:`.masks`: it is also copied into exported folders.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .masks import allowed_pairs, bool_mask, check_attention_args, packed_sequence_mask


def effective_softcap(module, softcap: float | None) -> float | None:
    """The cap rule, in one place: a patched module's scheme cap (``module._qknorm_softcap``, set by patching)
    overrides the ``softcap`` the model's own forward passes (Gemma 2 passes ``config.attn_logit_softcapping``);
    a module without a scheme cap gets the ``softcap`` it passed, exactly (an unpatched Gemma 2 keeps its cap)."""
    scheme = getattr(module, "_qknorm_softcap", None)  # getattr: Dynamo guards on it under torch.compile
    return softcap if scheme is None else scheme


def check_sink(sink, heads: int):
    """``s_aux`` (per-head attention-sink logits, gpt-oss) as a ``(heads,)`` tensor, or ``None``; refuses any other
    shape, naming it."""
    if sink is None:
        return None
    if not isinstance(sink, torch.Tensor) or sink.dim() != 1 or sink.shape[0] != heads:
        shape = tuple(sink.shape) if isinstance(sink, torch.Tensor) else type(sink).__name__
        raise ValueError(f"s_aux (attention sinks) must be a tensor of shape (heads,) = ({heads},), got {shape}")
    return sink


def capped_eager_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, is_causal=None, **kwargs
):
    """``softmax(mask(c * tanh(scaling * q k^T / c))) v`` in the ``AttentionInterface`` calling convention.

    ``query`` ``(batch, heads, q_len, head_dim)``; ``key``/``value`` ``(batch, kv_heads, kv_len, head_dim)``.
    The cap is :func:`effective_softcap`'s. The mask rule is :mod:`.masks` (a missing mask is top-left causal).
    ``s_aux`` (``(heads,)``, gpt-oss's attention sinks) joins each row's softmax denominator as one more logit,
    uncapped, as in the model's own eager attention; it attends to nothing. Rows with no allowed key give zeros.
    Returns ``(batch, q_len, heads, head_dim)`` and the weights ``(batch, heads, q_len, kv_len)`` in the query's
    dtype (with a sink, each row sums to less than 1)."""
    softcap = effective_softcap(module, softcap)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    check_attention_args(query, key, attention_mask, scaling, dropout, None)
    sink = check_sink(kwargs.get("s_aux"), query.shape[1])
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    groups = query.shape[1] // key.shape[1]
    k = key.to(acc).repeat_interleave(groups, dim=1)
    v = value.to(acc).repeat_interleave(groups, dim=1)
    s = torch.matmul(query.to(acc), k.transpose(-1, -2)) * scaling
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    ok = allowed_pairs(attention_mask, query.shape[2], key.shape[2], causal, query.device)
    packed = packed_sequence_mask(kwargs.get("position_ids"), query.shape[2], key.shape[2], bool_mask(attention_mask))
    if causal and packed is not None:  # sequences packed into a row with the cache on: see masks.py
        ok = packed if ok is None else ok & packed
    if ok is not None:
        s = s.masked_fill(~ok, float("-inf"))
    if sink is not None:  # one more logit per row, dropped after the softmax
        column = sink.to(acc).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        probs = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no allowed key: zeros, not NaN
    probs = F.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs, v).to(query.dtype)
    return out.transpose(1, 2).contiguous(), probs.to(query.dtype)

"""Plain PyTorch math for every scheme, written from the formulas: the tests' oracle.

Nothing here is optimised and nothing here is shared with the code under test: each function is the textbook
formula, materialising the full ``(seq, seq)`` logits. Run it in float64 to compare against the library.

Shapes: ``q`` is ``(batch, heads, q_len, head_dim)``; ``k`` and ``v`` are ``(batch, kv_heads, kv_len, head_dim)``
with ``heads % kv_heads == 0`` (GQA: query head ``h`` reads key/value head ``h // (heads // kv_heads)``).
"""

from __future__ import annotations

import torch


def norm_reference(x: torch.Tensor, kind: str, weight=None, bias=None, eps: float = 1e-6, p: float = 2.0):
    """The per-head norm over the last dimension."""
    if kind == "layernorm":
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        y = (x - mu) / torch.sqrt(var + eps)
    elif kind == "rmsnorm":
        y = x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps)
    elif kind in ("l2", "lp"):
        p = 2.0 if kind == "l2" else p
        y = x / (x.abs() ** p).sum(-1, keepdim=True).pow(1.0 / p).clamp_min(eps)
    else:
        raise ValueError(kind)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the half-split layout of Llama: ``x * cos + rotate_half(x) * sin``.
    ``x`` is ``(batch, heads, seq, head_dim)``, ``cos``/``sin`` are ``(batch, seq, head_dim)``."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rot * sin[:, None]


ROPE_LAYOUTS = ("half", "interleaved", "interleaved_from_half", "half_per_pair", "interleaved_per_pair")


def rope_layout_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """Rotary embedding of the first ``r`` channels of ``x`` (``r`` = ``cos.shape[-1]``; the rest pass unchanged:
    partial rotary), in one of :data:`ROPE_LAYOUTS`:

    - ``half``: Llama's ``x * cos + rotate_half(x) * sin``, channel ``i`` paired with ``i + r/2``;
    - ``interleaved``: Cohere's, channel ``2i`` paired with ``2i + 1`` (``cos`` already repeated per pair);
    - ``interleaved_from_half``: GLM's, interleaved pairs with the angles of the first half of a half-layout ``cos``;
    - ``half_per_pair``: gpt-oss's, ``cos`` holding one angle per pair (``r = 2 * cos.shape[-1]``), half-split pairs;
    - ``interleaved_per_pair``: GPT-J's (given its rotation since Transformers 5.2x), ``cos`` holding one angle per
      pair (``r = 2 * cos.shape[-1]``), interleaved pairs.

    ``x`` is ``(batch, heads, seq, head_dim)``, ``cos``/``sin`` are ``(batch, seq, r)``."""
    if layout not in ROPE_LAYOUTS:
        raise ValueError(f"unknown rotary layout {layout!r}; choose one of {', '.join(ROPE_LAYOUTS)}")
    if layout in ("half_per_pair", "interleaved_per_pair"):
        if layout == "half_per_pair":
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        else:
            cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        if cos.shape[-1] > x.shape[-1]:
            return torch.full_like(x, float("nan"))  # no such rotation of this width: matches nothing
    r = cos.shape[-1]
    if layout == "interleaved_from_half":
        cos = cos[..., : r // 2].repeat_interleave(2, dim=-1)
        sin = sin[..., : r // 2].repeat_interleave(2, dim=-1)
    head, rest = x[..., :r], x[..., r:]
    if layout in ("half", "half_per_pair"):
        return torch.cat((rope_reference(head, cos, sin), rest), dim=-1)
    pairs = head.unflatten(-1, (r // 2, 2))
    rot = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return torch.cat((head * cos[:, None] + rot * sin[:, None], rest), dim=-1)


def allowed_reference(
    q_len: int,
    kv_len: int,
    *,
    causal: bool,
    sliding_window: int | None = None,
    mask: torch.Tensor | None = None,
    prefix: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean ``(batch or 1, 1, q_len, kv_len)`` of the pairs a query may attend to.

    Causality is bottom-right aligned: query ``i`` sits at absolute position ``i + kv_len - q_len``. A sliding
    window of ``w`` keeps keys with ``pos_q - pos_k < w``. ``prefix`` ``(batch, kv_len)`` bool: a prefix-LM's
    prefix (PaliGemma's): a query and a key both in it attend whatever causality and the window say. ``mask``
    (True = attend) is intersected last."""
    qi = torch.arange(q_len)[:, None] + (kv_len - q_len)
    kj = torch.arange(kv_len)[None, :]
    ok = torch.ones(q_len, kv_len, dtype=torch.bool)
    if causal:
        ok = ok & (kj <= qi)
    if sliding_window is not None:
        ok = ok & (qi - kj < sliding_window)
    ok = ok[None, None]
    if prefix is not None:
        prefix = prefix.to(torch.bool).cpu()
        ok = ok | (prefix[:, None, kv_len - q_len :, None] & prefix[:, None, None, :])
    if mask is not None:
        ok = ok & mask.to(torch.bool).cpu()
    return ok


def attention_reference(
    q,
    k,
    v,
    *,
    scaling: float,
    softcap: float | None = None,
    causal: bool = True,
    mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    prefix: torch.Tensor | None = None,
) -> torch.Tensor:
    """``softmax(mask(c * tanh(scaling * q k^T / c))) v``; rows with no allowed key give zeros. ``sinks``
    ``(heads,)``: one more logit per row (uncapped, attending to nothing) in each head's softmax, as gpt-oss's.
    ``prefix``: a prefix-LM's prefix (:func:`allowed_reference`). Returns ``(batch, heads, q_len, head_dim)``."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    s = scaling * (q @ k.transpose(-1, -2))
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    ok = allowed_reference(
        q.shape[2], k.shape[2], causal=causal, sliding_window=sliding_window, mask=mask, prefix=prefix
    ).to(q.device)
    s = s.masked_fill(~ok, float("-inf"))
    if sinks is not None:
        column = sinks.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    p = torch.where(ok, p, torch.zeros((), dtype=p.dtype, device=p.device))  # fully masked rows: 0, not NaN
    p = torch.nan_to_num(p, nan=0.0)
    return p @ v


def attention_layer_reference(
    x,
    *,
    wq,
    wk,
    wv,
    wo,
    bq=None,
    bk=None,
    bv=None,
    bo=None,
    heads: int,
    kv_heads: int,
    head_dim: int,
    scaling: float,
    softcap=None,
    norm=None,
    q_norm=None,
    k_norm=None,
    v_norm=None,
    cos=None,
    sin=None,
    causal=True,
    mask=None,
    sliding_window=None,
    eps=1e-6,
    p=2.0,
    rope_layout="half",
    sinks=None,
    q_whole=None,
    k_whole=None,
    q_scale=None,
    v_own=None,
    kv=None,
    prefix=None,
):
    """One patched attention layer from the formulas, on hidden states ``x`` ``(batch, seq, hidden)``: project ->
    split heads -> norm -> RoPE -> attention (cap, mask, softmax) -> merge heads -> output projection. ``w*`` are
    ``(out, in)`` as in ``nn.Linear``; ``q_norm``/``k_norm``/``v_norm`` are dicts of the norm's ``weight``/``bias``
    (``None``: no norm on that input). The model's own parts, where it has them: ``q_whole``/``k_whole`` (dicts
    ``kind``, ``weight``, ``bias``, ``eps``) normalise the whole projection before the heads are split (OLMo 2);
    ``rope_layout`` and a ``cos`` narrower than ``head_dim`` (:func:`rope_layout_reference`); ``sinks``
    (:func:`attention_reference`); ``cos=None``: no rotation (NoPE); ``q_scale`` (broadcast to ``(batch, heads,
    seq, head_dim)``, e.g. ``(batch, 1, seq, 1)``): a factor by position on the rotated query (Beam's NoPE layers);
    ``v_own`` (dict ``kind``, ``weight``, ``bias``, ``eps``): the model's own per-head norm of v (Gemma 4's).
    ``kv``: the keys and values ``(batch, kv_heads, seq, head_dim)`` as the attention reads them, where the layer
    reuses another layer's (:func:`keys_values_reference` of that layer); ``wk``/``wv`` and the k/v settings are then
    not read. ``prefix`` ``(batch, seq)`` bool: a prefix-LM's prefix, attended both ways (:func:`allowed_reference`)."""
    b, t, _ = x.shape
    q = _heads(x, wq, bq, heads, head_dim, q_whole)
    if q_norm is not None:
        q = norm_reference(q, norm, q_norm.get("weight"), q_norm.get("bias"), eps=eps, p=p)
    q = q.transpose(1, 2)
    if cos is not None:
        q = rope_layout_reference(q, cos, sin, rope_layout)
    if q_scale is not None:
        q = q * q_scale
    if kv is None:
        kv = keys_values_reference(
            x,
            wk=wk,
            wv=wv,
            bk=bk,
            bv=bv,
            kv_heads=kv_heads,
            head_dim=head_dim,
            norm=norm,
            k_norm=k_norm,
            v_norm=v_norm,
            cos=cos,
            sin=sin,
            eps=eps,
            p=p,
            rope_layout=rope_layout,
            k_whole=k_whole,
            v_own=v_own,
        )
    k, v = kv
    o = attention_reference(
        q,
        k,
        v,
        scaling=scaling,
        softcap=softcap,
        causal=causal,
        mask=mask,
        sliding_window=sliding_window,
        sinks=sinks,
        prefix=prefix,
    )
    o = o.transpose(1, 2).reshape(b, t, heads * head_dim)
    return o @ wo.T + (bo if bo is not None else 0)


def _heads(x, w, bias, n: int, head_dim: int, whole=None):
    """``x`` projected by ``w`` (and ``bias``), normalised whole where the model does (``whole``), split into ``n``
    heads: ``(batch, seq, n, head_dim)``."""
    b, t, _ = x.shape
    y = x @ w.T + (bias if bias is not None else 0)
    if whole is not None:
        y = norm_reference(y, whole["kind"], whole.get("weight"), whole.get("bias"), eps=whole["eps"])
    return y.view(b, t, n, head_dim)


def keys_values_reference(
    x,
    *,
    wk,
    wv,
    bk=None,
    bv=None,
    kv_heads: int,
    head_dim: int,
    norm=None,
    k_norm=None,
    v_norm=None,
    cos=None,
    sin=None,
    eps=1e-6,
    p=2.0,
    rope_layout="half",
    k_whole=None,
    v_own=None,
):
    """The keys and values ``(batch, kv_heads, seq, head_dim)`` one layer's attention reads, from the formulas
    (projection, the model's own norms, the scheme's norms, RoPE on the keys); the arguments as
    :func:`attention_layer_reference`'s."""
    k, v = _heads(x, wk, bk, kv_heads, head_dim, k_whole), _heads(x, wv, bv, kv_heads, head_dim)
    if v_own is not None:
        v = norm_reference(v, v_own["kind"], v_own.get("weight"), v_own.get("bias"), eps=v_own["eps"])
    if k_norm is not None:
        k = norm_reference(k, norm, k_norm.get("weight"), k_norm.get("bias"), eps=eps, p=p)
    if v_norm is not None:
        v = norm_reference(v, norm, v_norm.get("weight"), v_norm.get("bias"), eps=eps, p=p)
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    if cos is not None:
        k = rope_layout_reference(k, cos, sin, rope_layout)
    return k, v

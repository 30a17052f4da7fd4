"""The optional native ops: ``_native.c``, built at install time by ``setup.py`` where a C compiler is.

Four users: the lean path's one-query capped attention (:func:`.lean._native_capped`: one call where the ATen ops
are six), the tiled path's capped elementwise passes (:mod:`.chunked`: one pass over a tile where the ATen ops make six
in forward and seven in backward, the causal band included) and the head layer norm of a projection's fresh output
when no gradient is recorded (:func:`layer_norm_in_place`, through
:data:`hf_qknorm.portable.hooks.LAYER_NORM_IN_PLACE`) and the decoding forward's rotary embedding of one position
(:func:`rotary_in_place`, :mod:`.fast`). All take float32 CPU tensors only and keep the ATen ops for
everything else.

``NATIVE[0]`` is the module in use, or ``None``: where it was not built, or ``HF_QKNORM_NATIVE=0`` (or ``off``,
``false``, ``no``) is set in the environment (then every call takes the ATen ops, to compare or to rule the op out).
Tests and benchmarks set the slot in-process.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn

try:
    from . import _native as MODULE
except ImportError:  # pragma: no cover - a build without a C compiler
    MODULE = None


_ON, _OFF = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


def _switch(value: str | None) -> bool:
    """``HF_QKNORM_NATIVE``: unset, empty or one of :data:`_ON` uses the op where it was built, one of :data:`_OFF`
    turns it off. Anything else warns, naming the value and the valid ones, and turns it off (the ATen ops run every
    call correctly; an import-time error would break every entry point, the CLI's included)."""
    value = "1" if value is None or not value.strip() else value.strip().lower()
    if value not in _ON + _OFF:
        warnings.warn(
            f"HF_QKNORM_NATIVE={value!r} is not one of {', '.join(_OFF + _ON)}: the native op is off",
            stacklevel=2,
        )
        return False
    return value in _ON


NATIVE = [MODULE if _switch(os.environ.get("HF_QKNORM_NATIVE")) else None]

# Above this many values with several threads, torch.layer_norm shares the rows among them; the op runs on one.
LAYER_NORM_PARALLEL_MAX = 1 << 16
_PLAIN = (torch.Tensor, nn.Parameter)  # the norm's parameters as the op reads them: no subclass


def layer_norm_in_place(x: torch.Tensor, head_dim: int, params) -> bool:
    """Normalise ``x`` -- a projection's output that nothing else holds yet, its last dimension whole heads -- in place
    with the head layer norm ``params`` (``(weight, bias, eps)``, :func:`~hf_qknorm.portable.hooks._layer_norm_params`)
    where the native op takes the call: plain float32 CPU tensors, contiguous, weight and bias of ``head_dim`` values,
    no gradient to record. True where it did; False where it did not (``x`` untouched: the caller makes the
    ``torch.layer_norm`` call). The values are ``torch.layer_norm``'s to float32 rounding (its statistics in double,
    rounded once). Decoding runs this for every normalised projection of every layer at every token: one call where
    ``torch.layer_norm`` and the views around it cost about four microseconds on one CPU thread."""
    module = NATIVE[0]
    if module is None:
        return False
    weight, bias, eps = params
    if (
        type(x) is not torch.Tensor  # a subclass (DTensor, a fake tensor) may keep its values elsewhere
        or type(weight) not in _PLAIN
        or type(bias) not in _PLAIN
        or x.dtype is not torch.float32  # the weight and bias have x's dtype (_layer_norm_params)
        or not (x.is_cpu and weight.is_cpu and bias.is_cpu)
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad))
        or not (x.is_contiguous() and weight.is_contiguous() and bias.is_contiguous())
        or weight.numel() != head_dim
        or bias.numel() != head_dim
        or x.numel() % head_dim
        or (x.numel() > LAYER_NORM_PARALLEL_MAX and torch.get_num_threads() > 1)
    ):
        return False
    module.layer_norm_f32(x.data_ptr(), x.numel() // head_dim, head_dim, weight.data_ptr(), bias.data_ptr(), eps)
    return True


def rotary_in_place(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Llama's rotary embedding (``apply_rotary_pos_emb``: ``x * cos + rotate_half(x) * sin``) of one position's
    ``query`` ``(batch, heads, 1, head_dim)`` and ``key`` ``(batch, kv_heads, 1, head_dim)`` in place, where the native
    op takes the call: plain float32 CPU tensors, the last dimension contiguous, ``cos`` and ``sin`` ``(batch | 1, 1,
    head_dim)`` with contiguous rows, an even head dim, no gradient to record. The same bits as the ATen ops (each
    product and sum rounded once, none fused). True where it did; False where it did not (nothing touched: the caller
    calls the family's function). The caller owns both tensors' memory: projections' fresh outputs, distinct, held
    by nothing else -- :mod:`.fast`, where decoding calls this at every layer and token in place of ATen ops costing
    about twenty microseconds of host time."""
    module = NATIVE[0]
    if module is None:
        return False
    plain = torch.Tensor
    if (
        type(query) is not plain
        or type(key) is not plain
        or type(cos) is not plain
        or type(sin) is not plain
        or query.dtype is not torch.float32
        or key.dtype is not torch.float32
        or cos.dtype is not torch.float32
        or sin.dtype is not torch.float32
        or not (query.is_cpu and key.is_cpu and cos.is_cpu and sin.is_cpu)
        or (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad))
        or query.dim() != 4
        or key.dim() != 4
        or cos.dim() != 3
    ):
        return False
    batch, heads, positions, dim = query.shape
    if (
        positions != 1
        or dim % 2
        or key.shape[0] != batch
        or key.shape[2:] != (1, dim)
        or cos.shape != sin.shape
        or cos.shape[1:] != (1, dim)
        or cos.shape[0] not in (1, batch)
        or query.stride(3) != 1
        or key.stride(3) != 1
        or cos.stride(2) != 1
        or sin.stride(2) != 1
        or ((query.numel() + key.numel()) > LAYER_NORM_PARALLEL_MAX and torch.get_num_threads() > 1)
    ):
        return False
    qs, ks = query.stride(), key.stride()
    shared = cos.shape[0] == 1  # one row of cos and sin for every batch entry
    module.rope_f32(
        query.data_ptr(), qs[0], qs[1], heads,
        key.data_ptr(), ks[0], ks[1], key.shape[1],
        cos.data_ptr(), 0 if shared else cos.stride(0), sin.data_ptr(), 0 if shared else sin.stride(0),
        batch, dim,
    )  # fmt: skip
    return True

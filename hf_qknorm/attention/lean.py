"""The lean path: attention of a few query tokens (decoding, speculative verification) when no gradient is needed,
as plain tensor math.

Decoding spends its time per token outside the arithmetic: for one query against a few hundred keys, the tiled path
(:mod:`.chunked`) costs an autograd ``Function``, a tile plan, packing copies and a clamp check that synchronises,
per layer per token -- about half of a tiny model's attention layer. Here the whole call is a handful of tensor ops
on the ``(batch, kv_heads, groups * q_len, kv_len)`` logits, which are small when the queries are few: one matmul
with the query heads of a GQA group packed against their shared key head (no ``repeat_kv`` copy), the cap as
``c * tanh`` in place, the mask, a softmax, one matmul. Nothing is allocated beyond the logits (and, for large
ones, the scratch of the cap's ``expm1`` form), and the host reads a mask once per forward -- whether any of its rows
is empty, which alone needs the NaN clean-up -- not once per layer.

Fewer and cheaper ops are the point: each costs one to a few microseconds of host time whatever its size, so the
scale and the cap are applied in place by 0-d tensors made once (a Python number would be made a tensor and converted
at every call) and one query's output needs no transpose. Where
the logits are many, elementwise cost per element counts instead: the ``expm1`` form of the cap's tanh
(:func:`~.tiles.tanh_doubled_`) costs less per element than ``torch.tanh`` but three more ops, so it takes over from
:data:`EXPM1_TANH_MIN` logits (where the two cross depends on the CPU: benchmarks/results/tuning.md).

Same semantics as the other paths (:func:`~hf_qknorm.attention.chunked.chunked_attention`): the cap before the mask,
a row with no allowed key gives zeros, a sink (``s_aux``) joins each row's denominator uncapped; accumulation in
float32 for half-precision inputs (float64 stays float64).

One capped float32 query per row on the CPU -- decoding's commonest call -- goes further: the optional native op
(``_native.c``, built at install time) does all of it in one call, the cost of the unpatched model's one sdpa call
(:func:`_native_capped`, for the calls :func:`.native.eligible` allows). ``HF_QKNORM_NATIVE=0`` in the environment, a
build without it, or any other call takes the ops above.

This module imports nothing but ``torch``, :mod:`.tiles` and :mod:`.native`.
"""

from __future__ import annotations

import torch

from . import native
from .native import NATIVE  # the native op in use, or None (:mod:`.native`)
from .tiles import TILE_ELEMENTS, position_mask, tanh_doubled_

# the native op takes head dims that are multiples of its vector width, up to its stack buffer (``_native.c``)
NATIVE_DIM_MULTIPLE, NATIVE_MAX_DIM = 8, 512

# The lean path takes calls of at most this many (query, head) rows per key head, the decoding entry point's limit
# (``q_len * heads / kv_heads <= 64``), and whose logits fit one tile of the tiled path.
MAX_ROWS = 64


def fits(batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int) -> bool:
    """Whether a call of these sizes is the lean path's: few queries, logits within one tile."""
    return q_len * (heads // kv_heads) <= MAX_ROWS and batch * heads * q_len * kv_len <= TILE_ELEMENTS


# From this many logits the cap's tanh goes through expm1: cheaper per element than torch.tanh, but three more ops,
# which cost more than they save on fewer logits (figures: benchmarks/results/tuning.md)
EXPM1_TANH_MIN = 4096
# Without a cap, one query's attention takes this path's math from this many logits, sdpa below: sdpa's fixed cost
# is lower on small calls, this path's packed GQA matmul cheaper on large ones (figures: benchmarks/results/tuning.md)
MATH_MIN = 4096

# (key, mask, its additive form shaped for the logits, whether every row of it lets a key through), key = the mask's
# identity and version, dtype, heads, kv_heads: every layer of a forward gets the same mask tensor, so this is done
# once per forward, not once per layer. One immutable entry, read once and replaced whole: a thread decoding beside
# another sees either's whole entry, never one's key with the other's bias (no lock on the hot path: one reference
# read, one reference write)
_BIAS_CACHE: tuple = (None, None, None, None)


# (value, dtype) -> that value as a 0-d CPU tensor. An in-place op with a Python number first makes it a tensor and
# converts it to the operand's dtype (``aten::_to_copy``): most of a ``mul_``'s time on few elements, per layer per
# token (benchmarks/results/tuning.md); with a 0-d tensor of the operand's dtype, none of that. CPU calls only
# (a GPU takes Python numbers, see lean_attention), so the key holds no device: making ``q.device`` costs half a
# microsecond per call.
_CONSTANTS: dict = {}
_CONSTANTS_MAX = 256  # a model has a few (scale, cap) pairs; a caller sweeping values does not grow this forever


def _constant(value: float, dtype: torch.dtype) -> torch.Tensor:
    """``value`` as a 0-d CPU tensor of ``dtype``, made once (rounded to ``dtype`` as the Python number would be in
    the op)."""
    key = (value, dtype)
    const = _CONSTANTS.get(key)
    if const is None:
        if len(_CONSTANTS) >= _CONSTANTS_MAX:
            _CONSTANTS.clear()
        const = _CONSTANTS[key] = torch.tensor(value, dtype=dtype)
    return const


def _additive(mask: torch.Tensor, dtype: torch.dtype, heads: int, kv_heads: int) -> tuple[torch.Tensor, bool]:
    """A boolean mask ``(batch|1, 1|heads, q_len|1, kv_len)`` as 0 (attend) / -inf (hidden) in ``dtype`` (``log(1) =
    0``, ``log(0) = -inf``), viewed to broadcast against the logits viewed as ``(batch, kv_heads, groups, q_len,
    kv_len)``; and whether every row lets at least one key through (then no row's softmax can be 0/0, and the NaN
    clean-up is skipped; found once per mask, not per layer; under ``torch.compile``, never assumed)."""
    global _BIAS_CACHE
    compiling = torch.compiler.is_compiling()
    if not compiling:
        key = (id(mask), mask._version, dtype, heads, kv_heads)
        cached_key, cached_mask, bias, every_row_open = _BIAS_CACHE  # the one read: checked and used from here
        if cached_mask is mask and cached_key == key:
            return bias, every_row_open
    bias = mask.to(dtype).log_()
    if bias.dim() == 4:
        per_head = bias.shape[1] == heads and heads > 1
        shape = (kv_heads, heads // kv_heads) if per_head else (1, 1)
        bias = bias.view(bias.shape[0], *shape, bias.shape[2], bias.shape[3])
    if compiling:
        return bias, False
    every_row_open = bool(mask.any(-1).all())
    _BIAS_CACHE = (key, mask, bias, every_row_open)
    return bias, every_row_open


_HALF = (torch.float16, torch.bfloat16)
# Whether ``torch.bmm`` takes ``out_dtype`` (``aten::bmm.dtype``, CUDA: half-precision operands, float32 products and
# sums, a float32 result); cleared at the first call that refuses it, which then takes the casts
_BMM_OUT_DTYPE = ["dtype" in torch.ops.aten.bmm.overloads()]


def _half_logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """``q k^T`` of half-precision CUDA operands as float32 in one launch, the values the float32 casts give (each
    product of two half-precision numbers is exact in float32; the sum is float32's), without the casts' two
    launches and copies; ``None`` under ``torch.compile`` (the compiled graph fuses the casts) or where this torch
    refuses the call."""
    if torch.compiler.is_compiling():
        return None
    try:
        return torch.bmm(q, k.mT, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        _BMM_OUT_DTYPE[0] = False
        return None


def lean_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None,
    mask: torch.Tensor | None,
    causal: bool,
    sliding_window: int | None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """``softmax(mask(c * tanh(scaling * q k^T / c)) [, sink]) v`` without autograd bookkeeping.

    ``query`` ``(batch, heads, q_len, head_dim)``; ``key``/``value`` ``(batch, kv_heads, kv_len, head_dim)``;
    ``mask`` boolean ``(batch|1, 1|heads, q_len, kv_len)`` (True = attend) and complete, or ``None`` with ``causal``
    and ``sliding_window`` bottom-right aligned (:func:`~hf_qknorm.attention.tiles.position_mask`); ``sink``
    ``(heads,)`` or ``None``. Returns ``(batch, q_len, heads, head_dim)`` in the query's dtype."""
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if q_len == 1 and softcap is not None and sink is None and NATIVE[0] is not None:
        out = _native_capped(query, key, value, scaling, softcap, mask, sliding_window)
        if out is not None:
            return out
    groups, n = heads // kv_heads, batch * key.shape[1]
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    # (batch * kv_heads, groups * q_len, head_dim): the heads of a group share one matmul against their key head
    q = query.reshape(n, groups * q_len, head_dim)
    k, v = key.reshape(n, kv_len, head_dim), value.reshape(n, kv_len, head_dim)
    # half precision on CUDA, eager: the logits straight from the half-precision operands into float32 (``bmm``'s
    # ``out_dtype``), with no float32 copies of the query and of the whole key cache, per layer per token
    logits = _half_logits(q, k) if q.dtype in _HALF and q.is_cuda and _BMM_OUT_DTYPE[0] else None
    if logits is not None:
        v = v.to(acc)
    elif q.dtype != acc or k.dtype != acc or v.dtype != acc:
        q, k, v = q.to(acc), k.to(acc), v.to(acc)
    # large logits on the CPU take tanh through expm1 (:func:`~.tiles.tanh_doubled_`, which wants 2x); small ones and
    # every GPU call torch.tanh, fewer ops where per-op overhead is the cost (a GPU's tanh is not the CPU's slow one)
    on_cpu = query.is_cpu  # not ``query.device.type``: a device object made per call costs half a microsecond
    doubled = softcap is not None and on_cpu and batch * heads * q_len * kv_len >= EXPM1_TANH_MIN
    scale = (2 * scaling if doubled else scaling) / softcap if softcap is not None else scaling
    # on the CPU, not compiling: scale and cap in place by 0-d tensors (_constant), cheaper than baddbmm's alpha (which
    # expands a zero input) or a Python number; elsewhere Python numbers (a tensor made on a GPU inside a CUDA graph
    # capture would be an error)
    constants = on_cpu and not torch.compiler.is_compiling()
    if logits is not None:
        s = logits.mul_(scale)
    elif constants:
        s = torch.bmm(q, k.mT).mul_(_constant(scale, acc))
    else:
        s = torch.bmm(q * scale, k.mT)
    if softcap is not None:
        cap = _constant(softcap, acc) if constants else softcap
        s = (tanh_doubled_(s, torch.empty_like(s)) if doubled else s.tanh_()).mul_(cap)
    if mask is None and ((causal and q_len > 1) or (sliding_window is not None and kv_len > sliding_window)):
        mask = position_mask(0, q_len, 0, kv_len, q_len, kv_len, causal, sliding_window, query.device)
    every_row_open = True
    if mask is not None:
        bias, every_row_open = _additive(mask, acc, heads, kv_heads)
        s.view(batch, kv_heads, groups, q_len, kv_len).add_(bias)
    if sink is not None:  # one more logit per row, dropped after the softmax
        column = sink.to(acc).view(1, kv_heads, groups, 1).expand(batch, -1, -1, q_len).reshape(n, groups * q_len, 1)
        p = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :kv_len]
    else:
        p = torch.softmax(s, dim=-1)
    if not every_row_open:
        p = p.nan_to_num_(0.0)  # a row with no allowed key: zeros, not NaN
    out = torch.bmm(p, v)
    # (batch, q_len, heads, head_dim): for one query the heads' rows are already in that order
    out = out.view(batch, 1, heads, head_dim) if q_len == 1 else out.view(batch, heads, q_len, head_dim).transpose(1, 2)
    return out if out.dtype == query.dtype else out.to(query.dtype)


def _native_capped(query, key, value, scaling, softcap, mask, sliding_window) -> torch.Tensor | None:
    """One query per row through the native op (:func:`.native.capped_cpu`): ``(batch, 1, heads, head_dim)``, or
    ``None`` where the call is not its own -- not :func:`.native.eligible`, a head dim it does not take, a row of the
    key or value cache not contiguous, a mask that is not a boolean CPU tensor over the keys."""
    batch, heads, _, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if dim % NATIVE_DIM_MULTIPLE or dim > NATIVE_MAX_DIM or kv_len == 0 or heads % kv_heads:
        return None
    if mask is None and sliding_window is not None and kv_len > sliding_window:  # one query sees the last keys
        key, value, kv_len = key[:, :, -sliding_window:], value[:, :, -sliding_window:], sliding_window
    if not native.eligible(query, key, value, batch * heads * kv_len):
        return None
    if query.stride(3) != 1 or key.stride(3) != 1 or value.stride(3) != 1:
        return None
    if mask is not None and (
        type(mask) is not torch.Tensor
        or mask.dtype is not torch.bool
        or not mask.is_cpu
        or mask.dim() != 4
        or mask.shape[2:] != (1, kv_len)
        or mask.shape[0] not in (1, batch)
        or mask.shape[1] not in (1, heads)
    ):
        return None
    return native.capped_cpu(query, key, value, mask, float(scaling), float(softcap))

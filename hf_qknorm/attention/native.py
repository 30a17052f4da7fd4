"""The optional native ops: ``_native.c``, built at install time by ``setup.py`` where GCC or Clang is.

Two users: the lean path's one-query capped attention (:func:`capped_decode`, the ``hf_qknorm::capped_decode``
custom op: one call where the ATen ops are six) and the tiled path's capped elementwise passes (:mod:`.chunked`, via
:func:`forward_tile`, :func:`backward_p` and :func:`backward_ds`: one pass over a tile where the ATen ops make six
in forward and seven in backward). Every call hands the C code the tensors themselves; the C code takes only a plain
``torch.Tensor``, reads each one's pointer, dtype, shape, strides and storage through the tensor's methods on every
call, and checks them all before it touches memory: a wrong call is a one-line ``ValueError`` naming the argument.
Which calls take the ops is one rule, :func:`eligible`.

``NATIVE[0]`` is the module in use, or ``None``: where it was not built, or ``HF_QKNORM_NATIVE=0`` (or ``off``,
``false``, ``no``) is set in the environment (then every call takes the ATen ops, to compare or to rule the op out).
A value the switch does not know fills it with a refusal: the first call the op would take raises (:class:`_Refused`).
Tests and benchmarks set the slot in-process.
"""

from __future__ import annotations

import torch

from ..kernels._env import SwitchError, switch

try:
    from . import _native as MODULE
except ImportError:  # pragma: no cover - a build without GCC or Clang
    MODULE = None


ENV = "HF_QKNORM_NATIVE"


def requested() -> bool:
    """``HF_QKNORM_NATIVE``: on, unset or empty uses the op where it was built; off turns it off. Another value
    raises ``ValueError`` (:func:`hf_qknorm.kernels._env.switch`)."""
    return switch(ENV, True, "the native op where it was built")


class _Refused:
    """The slot's value where ``HF_QKNORM_NATIVE`` holds a value it does not know. Importing still works (an error
    at import would break every entry point before the CLI could say what is wrong); the first call the op would
    take raises the switch's one-line ``ValueError``, so a misspelt switch never measures the other path."""

    def __init__(self, message: str):
        self.message = message

    def __getattr__(self, name: str):
        if name.startswith("__"):  # copy, pickle and hasattr probes: plain attribute semantics
            raise AttributeError(name)
        raise SwitchError(self.message)


def _initial():
    try:
        return MODULE if requested() else None
    except SwitchError as exc:
        return _Refused(str(exc))


NATIVE = [_initial()]

# The ops run on one thread. With one thread they beat the ATen ops at every size measured; with more, the ATen ops
# share large calls among the threads, so a call of more logits than this keeps them (``python
# benchmarks/bench_native.py --threads 2 --no-thread-limit`` shows where the two cross)
PARALLEL_MAX = 16384

_PLAIN = torch.Tensor  # a subclass (a DTensor, a fake tensor) may not hold its values at its data pointer


def grad_recorded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether autograd records this call through any of the three (then neither the lean path nor the op takes
    it)."""
    return torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)


def eligible(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, logits: int) -> bool:
    """Whether a call on these tensors, of ``logits`` logits (a tile's, or the whole call's), is the native ops':
    the op built and on, plain float32 CPU tensors, no gradient recorded, eager (``torch.compile`` traces the ATen
    ops, which it fuses), and one thread or at most :data:`PARALLEL_MAX` logits. The ops' own limits (head dims,
    caps, shapes) are their callers'; the C code refuses the rest."""
    return (
        NATIVE[0] is not None
        and type(query) is _PLAIN
        and type(key) is _PLAIN
        and type(value) is _PLAIN
        and query.dtype is torch.float32
        and key.dtype is torch.float32
        and value.dtype is torch.float32
        and query.is_cpu
        and key.is_cpu
        and value.is_cpu
        and not torch.compiler.is_compiling()
        and not grad_recorded(query, key, value)
        and (logits <= PARALLEL_MAX or torch.get_num_threads() == 1)
    )


def capped_cpu(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float, cap: float
) -> torch.Tensor:
    """``softmax(mask(cap * tanh(scale * q k^T / cap))) v`` for one query per row: ``query`` ``(batch, heads, 1,
    head_dim)``, ``key``/``value`` ``(batch, kv_heads, kv_len, head_dim)``, ``mask`` boolean ``(batch|1, heads|1, 1,
    kv_len)`` or ``None``; float32, last dimensions contiguous, a head dim a multiple of 8 up to 512. Returns ``(batch,
    1, heads, head_dim)``; a row with no allowed key gives zeros. The C code checks every argument."""
    shape = query.shape  # another rank: an empty out, and the C code names the query
    if len(shape) == 4:  # the sizes as separate arguments: torch.empty parses them faster than a tuple
        out = torch.empty(shape[0], 1, shape[1], shape[3], dtype=torch.float32)
    else:
        out = torch.empty(0, dtype=torch.float32)
    NATIVE[0].capped_f32(query, key, value, mask, out, scale, cap)
    return out


@torch.library.custom_op("hf_qknorm::capped_decode", mutates_args=(), device_types="cpu")
def capped_decode(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float, cap: float
) -> torch.Tensor:
    """:func:`capped_cpu` as a custom op (``torch.ops.hf_qknorm.capped_decode``), for ``torch.compile`` and other
    tracers; eager callers on the hot path call :func:`capped_cpu` itself (the dispatcher costs more than the op on
    small calls). Where the op was not built or is off, a ``RuntimeError`` saying so."""
    if NATIVE[0] is None:
        raise RuntimeError("hf_qknorm::capped_decode: the native op is not built or is off (HF_QKNORM_NATIVE)")
    return capped_cpu(query, key, value, mask, scale, cap)


@capped_decode.register_fake
def _(query, key, value, mask, scale, cap):
    if query.dim() != 4 or query.shape[2] != 1:
        raise ValueError(f"hf_qknorm::capped_decode: query must be (batch, heads, 1, head_dim), got {query.shape}")
    batch, heads, _, dim = query.shape
    return query.new_empty((batch, 1, heads, dim))


def forward_tile(op, x, kept, sums, gain: float, band=()) -> None:
    """The tiled forward's pass (``forward_f32`` of ``op``): ``x`` ``(blocks, rows, cols)`` of ``2s/c`` becomes the
    exponents, ``kept`` (or ``None``) the tanh, ``sums`` ``(blocks, rows, 1)`` the row sums."""
    op.forward_f32(x, kept, sums, gain, *band)


def backward_p(op, src, recompute: bool, neg_lse, p, slope, gain: float, band=()) -> None:
    """The tiled backward's first pass (``backward_p_f32``): the probabilities into ``p`` and the cap's slope into
    ``slope``, from ``src`` (``2s/c``, or the kept tanh) and the rows' ``neg_lse`` ``(blocks, rows, 1)``."""
    op.backward_p_f32(src, recompute, neg_lse, p, slope, gain, *band)


def backward_ds(op, dp, p, slope, delta) -> None:
    """The tiled backward's second pass (``backward_ds_f32``): ``dp`` becomes ``(dp - delta) * p * slope``."""
    op.backward_ds_f32(dp, p, slope, delta)

"""Which ``"qknorm"`` attention calls run the Triton kernels, and what happens when they cannot: a scoped policy.

After huggingface/kernels' ``kernelize(device=, use_fallback=)`` and its ``ContextVar``-backed
``use_kernel_mapping``. The policy is a :class:`KernelPolicy`, set for a block of code with :func:`kernel_policy`::

    from hf_qknorm.attention import kernel_policy

    with kernel_policy(use_fallback=False):        # the kernels, or an error that says why not
        model(**batch)
    with kernel_policy(devices=()):                # the PyTorch path everywhere (debugging, benchmarks)
        model(**batch)
    with kernel_policy(devices=("cuda", "cpu")):   # CPU tensors too, through Triton's interpreter (tests)
        model(**batch)
    with kernel_policy(flash_attn="off"):          # capped calls never delegated to FlashAttention
        model(**batch)

The default sends CUDA tensors to the kernels and everything else to the PyTorch path, and allows the fallback. While
the fallback is allowed, an eager decoding call on CUDA (a few queries, no gradient) takes the PyTorch path's lean
form even so: there the host's launch cost decides, and it launches cheaper (``hf_qknorm.attention.interface``).
Tensors on a device the policy does not name always take the PyTorch path, silently. On a device it names, a call
the kernels cannot run (Triton missing, float64, attention dropout, attention weights requested, attention sinks)
falls back to the PyTorch path with a warning logged once per reason (attention weights, asked for explicitly, fall
back without one) when ``use_fallback`` is true, and raises :class:`KernelFallbackError` naming the reason when it
is false.

``flash_attn`` decides whether a capped CUDA call the kernels would run goes to FlashAttention instead
(:mod:`.delegate`): ``"auto"`` (the default) where the installed package was measured faster than the kernels on this
card (the table in :mod:`.delegate`), ``"on"`` for every call that fits it, ``"off"`` never.

The policy lives in a ``contextvars.ContextVar``: a ``with`` block changes it for its own thread (or asyncio task)
only, blocks nest (an argument left out keeps the enclosing block's value), and the previous policy comes back on
exit, an exception included.

Under ``torch.compile`` the policy is read when the graph is traced (Dynamo cannot trace ``ContextVar.get``, so the
decision is a traced-in constant, :func:`torch.compiler.assume_constant_result`): a compiled model keeps the route
it was traced with until it is recompiled (``torch._dynamo.reset()``). With ``fullgraph=True`` a forbidden fallback
surfaces as Dynamo's ``Unsupported`` error whose message carries the :class:`KernelFallbackError`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import os

import torch

logger = logging.getLogger(__name__)

DEVICE_TYPES = ("cuda", "cpu")  # where the kernels can run: CUDA, and CPU under Triton's interpreter
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLASH_ATTN_CHOICES = ("auto", "on", "off")  # delegation of capped calls to FlashAttention (.delegate)


class KernelFallbackError(RuntimeError):
    """The Triton kernels cannot run a call, and the policy in force forbids the PyTorch path
    (``kernel_policy(use_fallback=False)``)."""


@dataclasses.dataclass(frozen=True)
class KernelPolicy:
    """Where the Triton kernels run (``devices``), whether a call they cannot run may take the PyTorch path
    (``use_fallback``; else :class:`KernelFallbackError`), and whether a capped call goes to FlashAttention
    (``flash_attn``, one of :data:`FLASH_ATTN_CHOICES`). Fields: docs/api.md (KernelPolicy)."""

    devices: tuple[str, ...] = ("cuda",)
    use_fallback: bool = True
    flash_attn: str = "auto"

    def __post_init__(self):
        devices = (self.devices,) if isinstance(self.devices, str) else self.devices
        try:
            devices = tuple(devices)
        except TypeError:
            raise TypeError(
                f"devices must be a tuple of device types from {DEVICE_TYPES}, got {self.devices!r}"
            ) from None
        unknown = [d for d in devices if d not in DEVICE_TYPES]
        if unknown:
            raise ValueError(
                f"unknown device type {unknown[0]!r} in devices={devices!r}; the kernels run on "
                f"{', '.join(map(repr, DEVICE_TYPES))}"
            )
        if not isinstance(self.use_fallback, bool):
            raise TypeError(f"use_fallback must be True or False, got {self.use_fallback!r}")
        if not isinstance(self.flash_attn, str) or self.flash_attn not in FLASH_ATTN_CHOICES:
            raise ValueError(
                f"flash_attn must be one of {', '.join(map(repr, FLASH_ATTN_CHOICES))}, got {self.flash_attn!r}"
            )
        object.__setattr__(self, "devices", tuple(dict.fromkeys(devices)))


_POLICY: contextvars.ContextVar[KernelPolicy] = contextvars.ContextVar(
    "hf_qknorm_kernel_policy", default=KernelPolicy()
)
_KEEP = object()  # "as in the enclosing policy"


def current_kernel_policy() -> KernelPolicy:
    """The policy in force in this thread (or asyncio task)."""
    return _POLICY.get()


@contextlib.contextmanager
def kernel_policy(*, devices=_KEEP, use_fallback=_KEEP, flash_attn=_KEEP):
    """Set the kernel policy for the ``with`` block (see the module docstring); yields the :class:`KernelPolicy` in
    force. An argument left out keeps the enclosing policy's value."""
    given = (("devices", devices), ("use_fallback", use_fallback), ("flash_attn", flash_attn))
    changes = {name: value for name, value in given if value is not _KEEP}
    policy = dataclasses.replace(_POLICY.get(), **changes)
    token = _POLICY.set(policy)
    try:
        yield policy
    finally:
        _POLICY.reset(token)


_warned: set[str] = set()


def _why_not(device_type: str, dtype: torch.dtype, dropout: float, weights: bool, sink: bool) -> str | None:
    """Why the kernels cannot run such a call, or None when they can."""
    if weights:
        return "attention weights were requested (output_attentions) and the kernels do not materialise them"
    if sink:
        return "the Triton kernels have no attention sinks (s_aux)"
    from .. import kernels

    reason = kernels.unavailable_reason()
    if reason is not None:
        return reason
    if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return (
            "CPU tensors run the kernels only under Triton's interpreter (TRITON_INTERPRET=1, set before "
            "hf_qknorm.kernels is imported)"
        )
    if dtype not in KERNEL_DTYPES:
        return f"dtype {dtype} is not supported by the Triton kernels (float16, bfloat16, float32)"
    if dropout > 0:
        return f"the Triton kernels have no attention dropout (dropout={dropout})"
    return None


@torch.compiler.assume_constant_result
def route(
    device_type: str, dtype: torch.dtype, dropout: float, weights: bool, sink: bool = False
) -> tuple[bool, str | None]:
    """Where one attention call goes under the policy in force: ``(True, None)`` for the kernels, ``(False, None)``
    for the PyTorch path (warned once per reason when it is a fallback), ``(False, reason)`` when the policy forbids
    the fallback -- the caller raises :class:`KernelFallbackError` with :func:`fallback_message` (raising here would
    surface as an internal Dynamo error under ``torch.compile``). A traced-in constant under ``torch.compile``."""
    policy = _POLICY.get()
    if device_type not in policy.devices:
        return False, None
    reason = _why_not(device_type, dtype, float(dropout), bool(weights), bool(sink))
    if reason is None:
        return True, None
    if not policy.use_fallback:
        return False, reason
    if not weights and reason not in _warned:  # weights are an explicit request: no warning for honouring it
        _warned.add(reason)
        logger.warning("qknorm attention: using the PyTorch path on %s because %s.", device_type, reason)
    return False, None


def fallback_message(device_type: str, reason: str) -> str:
    return (
        f"qknorm attention: the Triton kernels cannot run this call on {device_type}: {reason}; the PyTorch path "
        "is forbidden by kernel_policy(use_fallback=False)"
    )

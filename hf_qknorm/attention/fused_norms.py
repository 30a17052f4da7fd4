"""Route the per-head norms to the fused Triton kernels (:mod:`hf_qknorm.kernels.norms`) where the kernel policy
(:func:`.dispatch.kernel_policy`) sends a tensor's device to the kernels and the call is eager; under
``torch.compile`` the module's own forward runs (Inductor fuses it already), and so it does where no gradient is
taken (decoding: a Triton launch costs the host more than the ATen norm). Importing this module fills the slot
:data:`hf_qknorm.portable.hooks.FUSED_NORM` where a kernel may run (CUDA, or ``TRITON_INTERPRET=1``) and
``HF_QKNORM_FUSED_NORMS=1`` (or ``on``, ``true``, ``yes``) asks for it: opt-in until the kernels are measured against
the ATen norms on a GPU (docs/kernels.md); under the interpreter (the tests) it is on unless switched off."""

from __future__ import annotations

import math
import os

import torch

from ..kernels._env import SwitchError, switch
from ..portable import hooks
from .dispatch import current_kernel_policy

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def fused_head_norm(norm: torch.nn.Module, x: torch.Tensor):
    """``norm(x)`` through the kernel where the kernel policy sends ``x``'s device to the kernels, the call is eager
    and ``norm`` is exactly one of the package's norm classes with parameters the kernel takes; else None."""
    if torch.compiler.is_compiling() or x.dtype not in _KERNEL_DTYPES or x.shape[-1] == 0:
        return None
    if x.device.type not in current_kernel_policy().devices:
        return None
    if not torch.is_grad_enabled() or not (
        x.requires_grad or any(p is not None and p.requires_grad for p in norm._parameters.values())
    ):
        return None
    from .. import kernels

    if kernels.unavailable_reason() is not None:  # no Triton, or a broken one
        return None
    from ..kernels import norms
    from ..portable.norms import HeadLayerNorm, HeadLpNorm, HeadRMSNorm

    if x.device.type == "cpu" and type(norms._head_norm_fwd).__name__ != "InterpretedFunction":
        return None
    cls = type(norm)
    params = norm._parameters
    weight = params.get("weight")
    if weight is not None and weight.dtype not in _KERNEL_DTYPES:
        return None
    if cls is HeadLayerNorm:
        bias = params.get("bias")
        if weight is None or bias is None or bias.dtype not in _KERNEL_DTYPES:
            return None
        return norms.head_norm(x, weight, bias, kind="layernorm", eps=norm.eps)
    if cls is HeadRMSNorm:
        if weight is None:
            return None
        return norms.head_norm(
            x, weight, kind="rmsnorm", eps=norm.variance_epsilon, out_dtype=torch.promote_types(weight.dtype, x.dtype)
        )
    if cls is HeadLpNorm:
        if not (math.isfinite(norm.p) and norm.p >= 1):
            return None
        return norms.head_norm(x, weight, kind="lp", eps=norm.eps, p=norm.p)
    return None


ENV = "HF_QKNORM_FUSED_NORMS"


def requested(environ=os.environ) -> bool:
    """``HF_QKNORM_FUSED_NORMS``: on turns the fused norms on, off turns them off; unset or empty, on under Triton's
    interpreter only. Another value raises ``ValueError`` (:func:`hf_qknorm.kernels._env.switch`)."""
    interpreted = environ.get("TRITON_INTERPRET") == "1"
    return switch(ENV, interpreted, "on under Triton's interpreter only", environ)


def _refusal(message: str):
    def refuse(norm, x):
        raise SwitchError(message)

    return refuse


def install() -> None:
    """Fill :data:`hf_qknorm.portable.hooks.FUSED_NORM` where a kernel may run and it is asked for (idempotent).
    Where the switch holds a value it does not know, the slot refuses the first norm call with the switch's one-line
    ``ValueError`` instead: this runs at import, where raising would break every entry point, the CLI's included."""
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        return
    try:
        on = requested()
    except SwitchError as exc:
        hooks.FUSED_NORM = _refusal(str(exc))
        return
    if on:
        hooks.FUSED_NORM = fused_head_norm


install()

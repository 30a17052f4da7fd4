"""Triton kernels: capped flash attention.

Importing this package is always safe: it imports neither triton nor the kernel modules, and never touches CUDA.
Ask :func:`is_available` before using the kernels; the kernel modules are imported on first attribute access::

    from hf_qknorm import kernels
    if kernels.is_available():
        out = kernels.qknorm_attn_func(q, k, v, softcap=50.0)                       # padded batch
        out = kernels.qknorm_attn_varlen_func(q, k, v, cu_q, cu_k, softcap=50.0)    # packed sequences
        out = kernels.qknorm_attn_with_kvcache(q, k_cache, v_cache, softcap=50.0)   # decoding
        out, max_logits = kernels.qknorm_attn_func_with_max_logits(q, k, v, softcap=50.0)

One entry point per calling shape, each returning one type (:mod:`.attn_interface` documents shapes and dtypes).

The kernels run on CUDA tensors; on CPU they run under Triton's interpreter when ``TRITON_INTERPRET=1`` is set
before the first kernel module is imported (that is how the tests run them). Nothing here imports transformers.

With a soft cap, fp16/bf16 inputs on an NVIDIA GPU get the cap's ``tanh`` from the hardware instruction
``tanh.approx.f32`` (relative error about 2^-11, as in FlashAttention); ``HF_QKNORM_EXACT_TANH=1`` in the
environment, read at every launch, selects the exact float32 tanh instead, which fp32 inputs and Triton's
interpreter always use. :func:`tanh_mode` says which one this process uses.
"""

from __future__ import annotations

import importlib
import os

from ._env import switch

__all__ = [
    "is_available",
    "unavailable_reason",
    "tanh_mode",
    "AttnOutputWithMaxLogits",
    "qknorm_attn_func",
    "qknorm_attn_func_with_max_logits",
    "qknorm_attn_varlen_func",
    "qknorm_attn_varlen_func_with_max_logits",
    "qknorm_attn_with_kvcache",
]

MIN_TRITON = (3, 2)
_INSTALL_HINT = "pip install 'hf-qknorm[triton]'"

# public name -> (module, attribute); resolved lazily by __getattr__ below
_LAZY = {
    **{name: ("attn_interface", name) for name in __all__[3:]},
    "attn_fwd": ("attention", "attn_fwd"),
    "attn_bwd": ("attention", "attn_bwd"),
}


def unavailable_reason() -> str | None:
    """Why the Triton kernels cannot be used here, or None when they can. Imports triton (not the kernels) and
    never initialises CUDA."""
    try:
        import triton
    except ModuleNotFoundError as exc:
        if exc.name == "triton":
            return f"triton is not installed: {_INSTALL_HINT}"
        return f"triton failed to import ({exc}); reinstall it: {_INSTALL_HINT}"
    except Exception as exc:  # a broken install should disable the kernels, not break `import hf_qknorm`
        return f"triton failed to import ({type(exc).__name__}: {exc}); reinstall it: {_INSTALL_HINT}"
    try:
        version = tuple(int(x) for x in triton.__version__.split(".")[:2])
    except ValueError:
        return None  # a dev build with an odd version string: let it try
    if version < MIN_TRITON:
        return f"triton {triton.__version__} is too old (need >= {'.'.join(map(str, MIN_TRITON))}): {_INSTALL_HINT}"
    if os.environ.get("TRITON_INTERPRET") != "1":
        import torch

        if not torch.cuda.is_available():  # asks the driver; does not initialise a CUDA context
            return (
                "no CUDA device: the kernels run on NVIDIA GPUs (on CPU, tests run them through Triton's "
                "interpreter with TRITON_INTERPRET=1)"
            )
    return None


def is_available() -> bool:
    """True when the kernels can run here: triton is importable and recent enough, and there is a CUDA device (or
    Triton's interpreter is on, ``TRITON_INTERPRET=1``, as in the tests)."""
    return unavailable_reason() is None


EXACT_TANH_ENV = "HF_QKNORM_EXACT_TANH"
TMA_ENV = "HF_QKNORM_TMA"


def exact_tanh_requested() -> bool:
    """``HF_QKNORM_EXACT_TANH``: on asks for the exact tanh; off, unset or empty leaves the hardware one. Another
    value raises ``ValueError`` (:func:`._env.switch`). Read from the environment at each call."""
    return switch(EXACT_TANH_ENV, False, "tanh.approx.f32 for fp16/bf16 on NVIDIA GPUs")


def tma_requested() -> bool | None:
    """``HF_QKNORM_TMA``: on asks for the forward's tensor-descriptor loads wherever they apply, off refuses them even
    where the tile table asks; unset or empty leaves the table's choice (None). Another value raises ``ValueError``
    (:func:`._env.switch`). Read at each call."""
    return switch(TMA_ENV, None, "the tile table decides")


def tanh_mode() -> str:
    """How the capped kernels compute ``tanh`` for fp16/bf16 inputs in this process: ``"approx"``
    (``tanh.approx.f32``, on NVIDIA GPUs of compute capability 7.5 or later) or ``"exact"`` (asked for with
    ``HF_QKNORM_EXACT_TANH=1``, or Triton's interpreter, which cannot run inline assembly). fp32 inputs, and AMD
    GPUs, always get the exact tanh. Imports nothing."""
    if exact_tanh_requested() or os.environ.get("TRITON_INTERPRET") == "1":
        return "exact"
    return "approx"


def __getattr__(name: str):
    if name in _LAZY:
        reason = unavailable_reason()
        if reason is not None:
            raise ImportError(f"hf_qknorm.kernels.{name} needs triton: {reason}")
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

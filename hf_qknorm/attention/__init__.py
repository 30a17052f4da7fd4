"""The ``"qknorm"`` attention backend: the ``AttentionInterface`` function, its dispatch to the Triton kernels
(CUDA) or the PyTorch path under a scoped policy (:mod:`.dispatch`), and the memory-lean chunked path for capped
attention."""

from . import fused_norms  # noqa: F401  (fills hf_qknorm.portable.hooks.FUSED_NORM where a kernel may run)
from .dispatch import KernelFallbackError, KernelPolicy, current_kernel_policy, kernel_policy
from .interface import ATTN_IMPLEMENTATION, qknorm_attention_forward, register

__all__ = [
    "ATTN_IMPLEMENTATION",
    "KernelFallbackError",
    "KernelPolicy",
    "current_kernel_policy",
    "kernel_policy",
    "qknorm_attention_forward",
    "register",
]

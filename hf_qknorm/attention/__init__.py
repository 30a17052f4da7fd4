"""The ``"qknorm"`` attention backend: the ``AttentionInterface`` function, its dispatch to the Triton kernels
(CUDA) or the PyTorch path, and the memory-lean chunked path for capped attention."""

from .interface import ATTN_IMPLEMENTATION, qknorm_attention_forward, register, triton_on_cpu

__all__ = ["ATTN_IMPLEMENTATION", "qknorm_attention_forward", "register", "triton_on_cpu"]

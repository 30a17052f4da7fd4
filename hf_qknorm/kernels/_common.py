"""Small helpers shared by the Triton launchers: device checks, dtype maps, launch context.

Nothing here touches CUDA at import time; every device query happens inside a function, at call time.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_interpreted(kernel) -> bool:
    """Whether ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (the interpreter runs CPU tensors).

    ``triton.jit`` chooses compiled or interpreted when the decorator runs, i.e. when the kernel module is first
    imported, so the environment variable has to be set before that import; asking the kernel object is the only
    reliable way to know which mode we are in afterwards."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_device(kernel, *tensors: torch.Tensor, what: str = "inputs") -> None:
    """Refuse tensors the kernel cannot run on, with an error that says what to do instead."""
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(f"{what} must all be on the same device, got {sorted(map(str, devices))}")
    (device,) = devices
    if device.type == "cuda" or (device.type == "cpu" and is_interpreted(kernel)):
        return
    raise ValueError(
        f"the hf_qknorm Triton kernels run on CUDA tensors (got {what} on {device}); on CPU set "
        "TRITON_INTERPRET=1 before importing hf_qknorm.kernels to use Triton's interpreter, or use the PyTorch "
        "path in hf_qknorm.attention"
    )


def launch_context(device: torch.device):
    """Make ``device`` current while launching: Triton launches on the current CUDA device's stream."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def block_dim(head_dim: int) -> int:
    """Padded head dimension for a tile: a power of two, at least 16 (``tl.dot``'s smallest K)."""
    return max(16, triton.next_power_of_2(head_dim))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get IEEE fp32 products (``tl.dot`` would use TF32 on Ampere+ and lose ~3 digits);
    fp16/bf16 products are exact in the fp32 accumulator, so the default is fine there."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _probe():
    pass


# Whether this process decorates kernels for the interpreter; a constexpr global, so jit code can branch on it.
INTERPRETED = tl.constexpr(is_interpreted(_probe))


@triton.jit
def to_dtype(x, dtype: tl.constexpr):
    """``x.to(dtype)`` for an fp32 ``x``, rounding to nearest even everywhere.

    Compiled kernels already round fp32 -> bf16 to nearest even; Triton's interpreter truncates instead, which
    would make CPU tests of bf16 paths (and of Qwen3's bit-exact rmsnorm) disagree with the GPU. Under the
    interpreter only, round by hand on the bit pattern first (Inf and NaN survive it), so the cast is exact."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def dot(a, b, acc, PRECISION: tl.constexpr):
    """``tl.dot(a, b, acc)`` with fp32 accumulation. Under the interpreter, bf16 operands are widened first: it
    multiplies bf16's raw uint16 storage otherwise (Triton 3.9). Widening is exact, so results do not change."""
    if INTERPRETED and a.dtype == tl.bfloat16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)

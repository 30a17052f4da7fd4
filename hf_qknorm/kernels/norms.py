"""Fused per-head norms on CUDA: one Triton kernel per role, forward and backward, for every norm of
:mod:`hf_qknorm.portable.norms` (:class:`HeadLayerNorm`, :class:`HeadRMSNorm`, :class:`HeadLpNorm` with no scale,
its logit scale or a per-channel scale), matching each module's ``forward`` (dtypes included).

:func:`head_norm` is the autograd function on rows ``(..., head_dim)``; the router that picks it for a norm module
under the kernel policy is :func:`hf_qknorm.attention.fused_norms.fused_head_norm` (this floor imports nothing of
the package).
"""

from __future__ import annotations

import functools
import math

import torch
import triton

from ._common import check_device, launch_context
from ._norm_kernels import _head_norm_bwd, _head_norm_fwd

KINDS = {"layernorm": 0, "rmsnorm": 1, "lp": 2}


# A program's tile, in elements (rows x the head dim padded to a power of two): the forward's and the backward's
# (which holds more tensors per element). The backward runs BWD_PROGRAMS_PER_SM programs per multiprocessor (under
# the interpreter BWD_PROGRAMS_INTERPRETED), each looping over its share of the tiles. Chosen, not yet measured
# (benchmarks/bench_norms.py measures them and the ATen norms side by side on a GPU).
TILE_ELEMENTS_FWD = 4096
TILE_ELEMENTS_BWD = 2048
NUM_WARPS = 8
BWD_PROGRAMS_PER_SM = 4
BWD_PROGRAMS_INTERPRETED = 4


def block_rows(n_rows: int, block_d: int, elements: int) -> int:
    """Rows per tile: ``elements // block_d`` (a power of two, at least 1), no more than ``n_rows`` needs."""
    return max(1, min(elements // block_d, triton.next_power_of_2(max(n_rows, 1))))


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def bwd_programs(tiles: int, device: torch.device) -> int:
    """How many programs the backward runs for ``tiles`` tiles: at most a few per multiprocessor."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        cap = _multiprocessors(index) * BWD_PROGRAMS_PER_SM
    else:
        cap = BWD_PROGRAMS_INTERPRETED
    return max(1, min(tiles, cap))


class _HeadNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, kind, eps, p, offset, out_dtype):
        check_device(_head_norm_fwd, x, weight, bias)
        D = x.shape[-1]
        rows = x.reshape(-1, D).contiguous()
        n = rows.shape[0]
        y = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
        mean = torch.empty(n, dtype=torch.float32, device=x.device)
        rstd = torch.empty(n, dtype=torch.float32, device=x.device)
        block_d = triton.next_power_of_2(D)
        meta = dict(
            OFFSET=float(offset),
            KIND=KINDS[kind],
            HAS_W=weight is not None,
            W_SCALAR=weight is not None and weight.numel() == 1 and D != 1,
            HAS_B=bias is not None,
            P=2 if p == 2 else 0,
            BLOCK_D=block_d,
        )
        if n:
            block_r = block_rows(n, block_d, TILE_ELEMENTS_FWD)
            with launch_context(x.device):
                _head_norm_fwd[(triton.cdiv(n, block_r),)](
                    rows, weight, bias, y, mean, rstd, n, D, float(eps), float(p), BLOCK_R=block_r,
                    num_warps=NUM_WARPS, **meta
                )  # fmt: skip
        ctx.save_for_backward(rows, weight, bias, mean, rstd)
        ctx.meta, ctx.eps, ctx.p, ctx.shape = meta, float(eps), float(p), x.shape
        return y.view(*x.shape[:-1], D)

    @staticmethod
    def backward(ctx, gy):
        rows, weight, bias, mean, rstd = ctx.saved_tensors
        meta = ctx.meta
        n, D = rows.shape
        B = meta["BLOCK_D"]
        block_r = block_rows(n, B, TILE_ELEMENTS_BWD)
        programs = bwd_programs(triton.cdiv(n, block_r), rows.device)
        gy = gy.reshape(-1, D).contiguous()
        gx = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
        # one partial row per program, each written whole by its program
        gw = torch.empty(programs, B, dtype=torch.float32, device=rows.device) if weight is not None else None
        gb = torch.empty(programs, B, dtype=torch.float32, device=rows.device) if bias is not None else None
        if n:
            with launch_context(rows.device):
                _head_norm_bwd[(programs,)](
                    rows, weight, gy, gx, gw, gb, mean, rstd, n, D, ctx.eps, ctx.p, BLOCK_R=block_r,
                    num_warps=NUM_WARPS, **meta
                )  # fmt: skip
        dw = db = None
        if weight is not None and ctx.needs_input_grad[1]:
            dw = gw.sum(0)[: weight.numel()].view(weight.shape) if not meta["W_SCALAR"] else gw.sum().view(weight.shape)
            dw = dw.to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            db = gb.sum(0)[:D].to(bias.dtype)
        return gx.view(ctx.shape), dw, db, None, None, None, None, None


def head_norm(x, weight=None, bias=None, *, kind: str, eps: float, p: float = 2.0, offset: float = 0.0, out_dtype=None):
    """The per-head norm ``kind`` of ``x`` over its last dimension through the Triton kernels (differentiable in
    ``x``, ``weight`` and ``bias``). ``offset`` is added to the gain (``1 + w``: ``offset=1``); ``out_dtype`` defaults
    to ``x``'s dtype."""
    if kind not in KINDS:
        raise ValueError(f"unknown norm kind {kind!r}; the kernels have {', '.join(KINDS)}")
    if kind == "lp" and not (math.isfinite(p) and p >= 1):
        raise ValueError(f"the lp kernel needs a finite p >= 1, got {p}")
    return _HeadNorm.apply(x, weight, bias, kind, eps, p, offset, out_dtype or x.dtype)

"""Fused per-head norms on CUDA: one Triton kernel per role, forward and backward, for every norm of
:mod:`hf_qknorm.portable.norms` (:class:`HeadLayerNorm`, :class:`HeadRMSNorm`, :class:`HeadLpNorm` with no scale,
its logit scale or a per-channel scale), matching each module's ``forward`` (dtypes included).

:func:`head_norm` is the autograd function on rows ``(..., head_dim)``; the router that picks it for a norm module
under the kernel policy is :func:`hf_qknorm.attention.fused_norms.fused_head_norm` (this floor imports nothing of
the package).
"""

from __future__ import annotations

import math

import torch
import triton

from ._common import check_device, launch_context
from ._norm_kernels import _head_norm_bwd, _head_norm_fwd

KINDS = {"layernorm": 0, "rmsnorm": 1, "lp": 2}
_TINY = torch.finfo(torch.float32).tiny


ROWS_ONE_EACH = 4096  # up to this many rows one program per row; beyond, ROWS_PER_PROGRAM rows per program
ROWS_PER_PROGRAM = 4


def _rows_per_program(n_rows: int) -> int:
    return 1 if n_rows <= ROWS_ONE_EACH else ROWS_PER_PROGRAM


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
        R = _rows_per_program(n)
        grid = (triton.cdiv(n, R),)
        meta = dict(
            OFFSET=float(offset),
            KIND=KINDS[kind],
            HAS_W=weight is not None,
            W_SCALAR=weight is not None and weight.numel() == 1 and D != 1,
            HAS_B=bias is not None,
            P=2 if p == 2 else 0,
            ROWS=R,
            BLOCK_D=triton.next_power_of_2(D),
        )
        if n:
            with launch_context(x.device):
                _head_norm_fwd[grid](rows, weight, bias, y, mean, rstd, n, D, float(eps), float(p), **meta)
        ctx.save_for_backward(rows, weight, bias, mean, rstd)
        ctx.meta, ctx.eps, ctx.p, ctx.shape = meta, float(eps), float(p), x.shape
        return y.view(*x.shape[:-1], D)

    @staticmethod
    def backward(ctx, gy):
        rows, weight, bias, mean, rstd = ctx.saved_tensors
        meta = ctx.meta
        n, D = rows.shape
        R = meta["ROWS"]
        programs = triton.cdiv(n, R)
        gy = gy.reshape(-1, D).contiguous()
        gx = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
        B = meta["BLOCK_D"]
        gw = torch.zeros(programs, B, dtype=torch.float32, device=rows.device) if weight is not None else None
        gb = torch.zeros(programs, B, dtype=torch.float32, device=rows.device) if bias is not None else None
        if n:
            with launch_context(rows.device):
                _head_norm_bwd[(programs,)](rows, weight, gy, gx, gw, gb, mean, rstd, n, D, ctx.eps, ctx.p, **meta)
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

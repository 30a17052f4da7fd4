"""Fused per-head norm + RoPE: launchers, ``torch.library`` custom ops and the public :func:`norm_rope`.

Where it sits: after the q/k/v projection, viewed per head as ``(batch, seq, heads, head_dim)`` and before the
``transpose(1, 2)`` into attention layout. One kernel reads the projection output once and writes the normalised,
rotated result once, instead of the ~6 passes of the unfused PyTorch code (norm in fp32, cast, weight, then RoPE's
``x * cos``, ``rotate_half``, ``* sin``, add).
"""

from __future__ import annotations

import math

import torch
import triton

from ._common import SUPPORTED_DTYPES, check_device, is_interpreted, launch_context
from ._norm_rope_kernels import _norm_rope_bwd_kernel, _norm_rope_fwd_kernel

__all__ = ["norm_rope", "norm_rope_fwd", "norm_rope_bwd"]

KINDS = {"layernorm": 0, "rmsnorm": 1, "lp": 2, "l2": 2}


def _check(x, kind, weight, bias, eps, p, cos, sin):
    if kind not in KINDS:
        raise ValueError(f"unknown norm kind {kind!r}; valid kinds: {', '.join(KINDS)}")
    if x.dim() != 4:
        raise ValueError(f"x must be (batch, seq, heads, head_dim), got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    check_device(_norm_rope_fwd_kernel, x, weight, bias, cos, sin, what="x, weight, bias, cos and sin")
    d = x.shape[-1]
    allowed_w = {"layernorm": [(d,)], "rmsnorm": [(d,)], "lp": [(1,), (d,)], "l2": [(1,), (d,)]}[kind]
    if weight is not None and tuple(weight.shape) not in allowed_w:
        raise ValueError(f"{kind} weight must have shape {' or '.join(map(str, allowed_w))}, got {tuple(weight.shape)}")
    if bias is not None and (kind != "layernorm" or tuple(bias.shape) != (d,)):
        raise ValueError(f"only layernorm takes a bias, of shape ({d},); got {kind} with {tuple(bias.shape)}")
    if not (eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a finite float >= 0, got {eps}")
    if kind == "lp" and not (p > 0 and math.isfinite(p)):
        raise ValueError(f"p must be a finite float > 0, got {p}")
    if (cos is None) != (sin is None):
        raise ValueError("pass both cos and sin, or neither")
    if cos is not None:
        want = (x.shape[0], x.shape[1], d)
        for name, t in (("cos", cos), ("sin", sin)):
            if t.dim() != 3 or t.shape[0] not in (1, want[0]) or tuple(t.shape[1:]) != want[1:]:
                raise ValueError(f"{name} must be (batch or 1, seq, head_dim) = {want}, got {tuple(t.shape)} "
                                 "(partial rotary embeddings are not supported)")
        if d % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {d}")


def _prepare(x, kind, weight, cos, sin):
    x = x if x.stride(-1) == 1 else x.contiguous()
    rope = []
    for t in (cos, sin):
        if t is None:
            rope += [x, 0, 0]  # dummy pointer, never read
        else:
            t = t if t.stride(-1) == 1 else t.contiguous()
            t = t.expand(x.shape[0], *t.shape[1:])
            rope += [t, t.stride(0), t.stride(1)]
    flags = dict(D=x.shape[-1], BLOCK_D=triton.next_power_of_2(x.shape[-1]), KIND=KINDS[kind],
                 HAS_W=weight is not None, W_SCALAR=weight is not None and weight.numel() == 1,
                 HAS_ROPE=cos is not None)
    return x, rope, flags


def _block_rows(head_dim: int, interpreted: bool) -> int:
    # ~4K elements per program on GPU (memory-bound: enough bytes in flight per SM); bigger under the interpreter,
    # whose cost is per program.
    return max(1, (16384 if interpreted else 4096) // triton.next_power_of_2(head_dim))


def norm_rope_fwd(x, *, kind: str, weight=None, bias=None, eps: float = 1e-6, p: float = 2.0, cos=None, sin=None):
    """Forward launcher: ``(batch, seq, heads, head_dim)`` contiguous in x's dtype. See :func:`norm_rope`."""
    _check(x, kind, weight, bias, eps, p, cos, sin)
    x, (c, scb, sct, s, ssb, sst), flags = _prepare(x, kind, weight, cos, sin)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows = x.shape[0] * x.shape[1] * x.shape[2]
    if n_rows == 0:
        return y
    block_r = _block_rows(x.shape[-1], is_interpreted(_norm_rope_fwd_kernel))
    with launch_context(x.device):
        _norm_rope_fwd_kernel[(triton.cdiv(n_rows, block_r),)](
            x, y, weight if weight is not None else x, bias if bias is not None else x, c, s,
            n_rows, x.shape[1], x.shape[2], x.stride(0), x.stride(1), x.stride(2), scb, sct, ssb, sst,
            float(eps), float(p), BLOCK_R=block_r, HAS_B=bias is not None, IS_L2=kind == "l2" or float(p) == 2.0,
            **flags,
        )
    return y


def norm_rope_bwd(dy, x, *, kind: str, weight=None, bias=None, eps: float = 1e-6, p: float = 2.0, cos=None,
                  sin=None):
    """Backward launcher: ``(dx, dweight, dbias)``; dx like x (contiguous), dweight/dbias shaped and typed like
    weight/bias, or None where those are None. No gradient for cos/sin (RoPE tables are buffers)."""
    _check(x, kind, weight, bias, eps, p, cos, sin)
    if dy.shape != x.shape:
        raise ValueError(f"dy {tuple(dy.shape)} does not match x {tuple(x.shape)}")
    x, (c, scb, sct, s, ssb, sst), flags = _prepare(x, kind, weight, cos, sin)
    dy = dy.contiguous()
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows, d = x.shape[0] * x.shape[1] * x.shape[2], x.shape[-1]
    interpreted = is_interpreted(_norm_rope_fwd_kernel)
    block_r = _block_rows(d, interpreted)
    num_blocks = triton.cdiv(n_rows, block_r)
    if x.device.type == "cuda":
        nprog = torch.cuda.get_device_properties(x.device).multi_processor_count * 4
    else:
        nprog = 4
    nprog = max(1, min(num_blocks, nprog))
    dw_part = torch.zeros((nprog, d), dtype=torch.float32, device=x.device) if weight is not None else None
    db_part = torch.zeros((nprog, d), dtype=torch.float32, device=x.device) if bias is not None else None
    if n_rows:
        with launch_context(x.device):
            _norm_rope_bwd_kernel[(nprog,)](
                dy, x, weight if weight is not None else x, c, s, dx,
                dw_part if dw_part is not None else dx, db_part if db_part is not None else dx,
                n_rows, x.shape[1], x.shape[2], num_blocks, x.stride(0), x.stride(1), x.stride(2),
                scb, sct, ssb, sst, float(eps), float(p),
                BLOCK_R=block_r, HAS_B=bias is not None, IS_L2=kind == "l2" or float(p) == 2.0, **flags,
            )
    dw = db = None
    if weight is not None:
        dw = (dw_part.sum() if weight.numel() == 1 else dw_part.sum(0)).reshape(weight.shape).to(weight.dtype)
    if bias is not None:
        db = db_part.sum(0).to(bias.dtype)
    return dx, dw, db


# --------------------------------------------------------------------------------------------------------------
# custom ops (see attention.py for why): absent weight/bias gradients are returned as empty (0,) tensors, because
# an op's outputs cannot be None.
# --------------------------------------------------------------------------------------------------------------

_ARGS = "Tensor? weight, Tensor? bias, Tensor? cos, Tensor? sin, str kind, float eps, float p"


@torch.library.custom_op("hf_qknorm::norm_rope_fwd", mutates_args=(), schema=f"(Tensor x, {_ARGS}) -> Tensor")
def _norm_rope_fwd_op(x, weight, bias, cos, sin, kind, eps, p):
    return norm_rope_fwd(x, kind=kind, weight=weight, bias=bias, eps=eps, p=p, cos=cos, sin=sin)


@_norm_rope_fwd_op.register_fake
def _norm_rope_fwd_fake(x, *args):
    return x.new_empty(x.shape)


@torch.library.custom_op("hf_qknorm::norm_rope_bwd", mutates_args=(),
                         schema=f"(Tensor dy, Tensor x, {_ARGS}) -> (Tensor, Tensor, Tensor)")
def _norm_rope_bwd_op(dy, x, weight, bias, cos, sin, kind, eps, p):
    dx, dw, db = norm_rope_bwd(dy, x, kind=kind, weight=weight, bias=bias, eps=eps, p=p, cos=cos, sin=sin)
    return dx, (dw if dw is not None else x.new_empty((0,))), (db if db is not None else x.new_empty((0,)))


@_norm_rope_bwd_op.register_fake
def _norm_rope_bwd_fake(dy, x, weight, bias, *args):
    return (x.new_empty(x.shape), weight.new_empty(weight.shape) if weight is not None else x.new_empty((0,)),
            bias.new_empty(bias.shape) if bias is not None else x.new_empty((0,)))


def _setup_context(ctx, inputs, output):
    x, weight, bias, cos, sin, kind, eps, p = inputs
    ctx.save_for_backward(x, weight, bias, cos, sin)
    ctx.params = (kind, eps, p)


def _backward(ctx, dy):
    x, weight, bias, cos, sin = ctx.saved_tensors
    dx, dw, db = torch.ops.hf_qknorm.norm_rope_bwd(dy, x, weight, bias, cos, sin, *ctx.params)
    return dx, (dw if weight is not None else None), (db if bias is not None else None), None, None, None, None, None


torch.library.register_autograd("hf_qknorm::norm_rope_fwd", _backward, setup_context=_setup_context)


def norm_rope(x: torch.Tensor, *, kind: str, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
              eps: float = 1e-6, p: float = 2.0, cos: torch.Tensor | None = None,
              sin: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head norm over ``head_dim`` followed by RoPE, fused and differentiable (x, weight, bias).

    Args:
        x: ``(batch, seq, heads, head_dim)``, the projection output viewed per head (before the transpose);
            float16, bfloat16 or float32; last dimension contiguous.
        kind: ``"layernorm"`` (weight and bias ``(head_dim,)``), ``"rmsnorm"`` (weight ``(head_dim,)``,
            Qwen3RMSNorm arithmetic), ``"lp"`` / ``"l2"`` (``x / max(||x||_p, eps)``, weight ``(1,)`` -- a logit
            scale -- or ``(head_dim,)``, or None). Weights are shared by all heads.
        eps: added to the variance (layernorm, rmsnorm) or the lower bound of the norm (lp).
        p: the norm's order for ``"lp"`` (``"l2"`` forces 2).
        cos, sin: ``(batch or 1, seq, head_dim)`` in Llama's half-split (``rotate_half``) layout, any float dtype;
            None for the norm alone (e.g. values, or GPT-2's learned positions).

    Returns:
        ``(batch, seq, heads, head_dim)`` in x's dtype, contiguous. Computed in fp32 and rounded once, so with RoPE
        it can differ from the unfused bf16 code (which rounds after every op) by an ulp or two; without RoPE the
        rmsnorm output is bit-identical to Qwen3RMSNorm for matching weight and input dtypes.
    """
    if kind == "l2":
        p = 2.0
    return torch.ops.hf_qknorm.norm_rope_fwd(x, weight, bias, cos, sin, kind, float(eps), float(p))

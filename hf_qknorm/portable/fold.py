"""The ``qkv_norm`` pre-norm fold: the one rule, used by :func:`hf_qknorm.patch_model` (on modules) and by the
converter (on checkpoint tensors), so the two cannot disagree.

``qkv_norm`` removes the block's pre-attention norm ``y = g * n(x) + b``. The projections that read ``y`` keep their
pretrained behaviour on the normalised direction ``n(x)``:

    W y + c  =  W (g * n + b) + c  =  (W diag(g)) n + (W b + c)

so the gain ``g`` scales the projections' input channels and the bias ``b`` becomes a shift of their biases. The
arithmetic runs in float32 (float64 stays float64) and the results are cast back to each tensor's dtype once.
"""

from __future__ import annotations

import torch


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def fold_gain(weight: torch.Tensor, gain: torch.Tensor, conv1d: bool) -> torch.Tensor:
    """``W diag(g)``: ``weight`` is ``(out, in)`` (``nn.Linear``) or ``(in, out)`` (``transformers.Conv1D``);
    ``gain`` is ``(in,)``. Returns a new tensor of ``weight``'s dtype."""
    acc = _acc(weight)
    g = gain.to(acc)
    scaled = weight.to(acc) * (g[:, None] if conv1d else g[None, :])
    return scaled.to(weight.dtype)


def bias_shift(weight: torch.Tensor, prenorm_bias: torch.Tensor, conv1d: bool) -> torch.Tensor:
    """``W b``, the constant the removed pre-norm's bias contributes to the projection, in float32 (or float64).
    Computed from the *unfolded* weight: ``W (g * n + b) = (W diag g) n + W b``."""
    acc = _acc(weight)
    w, b = weight.to(acc), prenorm_bias.to(acc)
    return b @ w if conv1d else w @ b


def shifted_bias(bias: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``c + W b`` in the accumulation dtype, cast back to ``bias``'s dtype."""
    return (bias.to(shift.dtype) + shift).to(bias.dtype)


@torch.no_grad()
def affine_form(norm, skip_probe: bool = False):
    """``(gain, bias)`` with which a norm module computes ``gain * n(x) + bias`` (``n``: RMS or mean-and-variance
    normalisation over the last dimension), each ``None`` where absent: Llama's RMSNorm gives ``(weight, None)``,
    Gemma's ``(1 + weight, None)``, LayerNorm ``(weight, bias)``. Read off the module by a probe (a few random rows
    through it, both normalisations tried) and snapped to the module's own tensors, so a Llama's fold is bit-for-bit
    what it was. ``(None, None)`` for a parameter-free norm; ``ValueError`` for a module of no such form.
    ``skip_probe`` (a model being built for loading, whose weights are about to be replaced): the module's own
    ``weight``/``bias``."""
    weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
    weight = weight if isinstance(weight, torch.Tensor) else None
    bias = bias if isinstance(bias, torch.Tensor) else None
    if skip_probe or (weight is not None and weight.is_meta):
        return weight, bias
    if weight is not None and weight.dim() == 0:  # a scalar, no per-channel gain (Gemma 3n's v norm on 5.4: 1.0)
        if bias is None and float(weight) == 1.0:
            return None, None
        raise ValueError(f"{type(norm).__name__} has a scalar weight {float(weight):g}, not a per-channel gain")
    width = weight.shape[-1] if weight is not None else None
    if width is None:
        return None, None  # a parameter-free norm: nothing to fold, nothing to carry
    ref = weight if weight.is_floating_point() else torch.empty(0)
    x = torch.randn(64, width, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    y = norm(x.to(device=ref.device, dtype=ref.dtype)).to(torch.float64).cpu()
    for centred in (False, True):
        h = x - x.mean(-1, keepdim=True) if centred else x
        n = h / h.pow(2).mean(-1, keepdim=True).sqrt()
        a, b = _fit(n, y)
        scale = y.abs().max().clamp_min(1e-12)
        tol = 2e-2 if ref.dtype in (torch.float16, torch.bfloat16) else 1e-4
        if (a * n + b - y).abs().max() <= tol * scale:
            return _snap(a, weight, tol), _snap_bias(b, bias, tol, scale)
    raise ValueError(f"{type(norm).__name__} does not compute gain * n(x) + bias")


def _fit(n: torch.Tensor, y: torch.Tensor):
    """Per-channel least squares ``y = a * n + b`` over the rows."""
    nm, ym = n.mean(0), y.mean(0)
    var = (n - nm).pow(2).mean(0).clamp_min(1e-30)
    a = ((n - nm) * (y - ym)).mean(0) / var
    return a, ym - a * nm


def _snap(a: torch.Tensor, weight: torch.Tensor, tol: float) -> torch.Tensor:
    """The module's own tensor where the fitted gain is it (``weight``, or ``1 + weight``), else the fit."""
    w = weight.detach().to(torch.float64).cpu()
    if torch.allclose(a, w, rtol=tol, atol=tol):
        return weight
    if torch.allclose(a, 1 + w, rtol=tol, atol=tol):
        return 1 + weight.detach().to(torch.promote_types(weight.dtype, torch.float32))
    return a.to(device=weight.device, dtype=weight.dtype)


def _snap_bias(b: torch.Tensor, bias, tol: float, scale) -> torch.Tensor | None:
    if bias is not None and torch.allclose(b, bias.detach().to(torch.float64).cpu(), rtol=tol, atol=tol * scale):
        return bias
    if b.abs().max() <= tol * scale:
        return None
    return b if bias is None else b.to(device=bias.device, dtype=bias.dtype)

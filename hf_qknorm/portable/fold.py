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

"""The new norms of one attention layer, fitted to that layer's output (the layer-wise objective).

Two steps per layer, on the calibration activations that reach it:

1. **Closed form** (:func:`closed_form`): per channel, the least-squares fit of the original per-head q/k/v (before
   RoPE) on the parameter-free norm of the projection, from the sums
   :class:`hf_qknorm.conversion.calibration.stats._Moments` gathers (for ``l2``/``lp``: the logit scale ``scaling *
   E||q||_p * E||k||_p``).
2. **Local fit** (:func:`fit_attention`): Adam on the new norm parameters only, minimising the squared error of the
   patched attention layer's output (after its output projection) against the original layer's output on the same
   inputs, relative to the output's mean square. Matching q and k vectors is not what matters: a norm rescales
   every token's query and key to the same size, and on a real model the keys that attention sinks on (the first
   token's, in most layers) are several times *smaller* than the others, so the closed form -- which matches average
   sizes -- hands them the largest logits and attention collapses onto them. Fitting the layer's output weighs
   each channel by its effect on attention.

Weights (gains, the logit scale) are fitted as ``w0 * exp(theta)`` (relative steps, signs kept), biases as
``b0 + rms(w0) * theta``, with a cosine-decayed step size; one calibration block per step. The fit is kept only if
it lowers the error on all calibration blocks; otherwise the closed form stays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from ...portable.norms import HeadLayerNorm, HeadLpNorm, HeadRMSNorm
from .optim import cosine_adam, scaled_groups
from .streaming import BlockCall, StreamMapping


@dataclass
class FitResult:
    error_closed_form: float  # relative squared error of the attention output with the closed form
    error: float  # ... with the kept parameters
    kept_fit: bool  # False when the local fit did not improve on the closed form


def scheme_norms(attn: nn.Module) -> dict[str, str]:
    """Role -> attribute of the patched ``attn`` holding the scheme's norm for it (``q_norm``, a native slot such as
    Persimmon's ``q_layernorm``, or ``qknorm_q_norm`` beside a norm the model keeps)."""
    return dict(attn.__dict__.get("_qknorm_norms", {}))


def closed_form(attn: nn.Module, moments: dict, scaling: float) -> None:
    """Set the new norms of the patched ``attn`` from the least-squares sums ``moments[role]``."""
    with torch.no_grad():
        for role, name in scheme_norms(attn).items():
            norm = attn._modules[name]
            if moments[role].count:
                _init_norm(norm, role, moments, scaling)


def _init_norm(norm: nn.Module, role: str, moments: dict, scaling: float) -> None:
    if isinstance(norm, HeadLayerNorm):
        w, b = moments[role].fit(intercept=True)
        norm.weight.copy_(w)
        norm.bias.copy_(b)
    elif isinstance(norm, HeadRMSNorm):
        norm.weight.copy_(moments[role].fit(intercept=False)[0])
    elif isinstance(norm, HeadLpNorm) and norm.scale == "channel":
        norm.weight.copy_(moments[role].fit(intercept=False)[0])
    elif isinstance(norm, HeadLpNorm) and norm.scale == "logit":
        mq, mk = moments["q"], moments["k"]
        if not mk.count:  # a layer attending over an earlier layer's keys: its own init, fitted next
            return
        norm.weight.fill_(scaling * (mq.norm_p_sum / mq.count) * (mk.norm_p_sum / mk.count))


def norm_parameters(attn: nn.Module) -> dict[str, nn.Parameter]:
    """The new norms' parameters of the patched ``attn``, by name relative to it (``q_norm.weight`` ...)."""
    out = {}
    for name in scheme_norms(attn).values():
        out.update({f"{name}.{k}": p for k, p in attn._modules[name].named_parameters()})
    return out


def attention_output(attn: nn.Module, call: BlockCall, overrides: dict | None = None) -> torch.Tensor:
    """``attn``'s output (after its output projection) for one recorded call, with parameters ``overrides``."""
    out = attention_output_tuple(attn, call, overrides)
    return out[0] if isinstance(out, tuple) else out


def attention_output_tuple(attn: nn.Module, call: BlockCall, overrides: dict | None = None):
    """What ``attn``'s forward returns for one recorded call, with parameters ``overrides``."""
    args, kwargs = call.args, call.kwargs
    return functional_call(attn, overrides or {}, args, kwargs, strict=False) if overrides else attn(*args, **kwargs)


def attention_with_weights(
    attn: nn.Module, call: BlockCall, overrides: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attn``'s output (after its output projection) and its attention probabilities ``(batch, heads, q_len,
    kv_len)`` for one recorded call, on the ``"qknorm"`` backend (the conversion's models run on it) asked for its
    weights (:func:`~hf_qknorm.attention.interface.returning_weights`): its materialising path, the cap, mask,
    window and sinks applied as in its other paths (a row with a sink sums to less than 1)."""
    from ...attention.interface import returning_weights

    with returning_weights():
        out = attention_output_tuple(attn, call, overrides)
    weights = out[1] if isinstance(out, tuple) and len(out) > 1 else None
    if not torch.is_tensor(weights) or weights.dim() != 4:
        raise ValueError(
            f"{type(attn).__name__} returns no attention weights when asked, which heal attention kl needs; heal "
            "this model with --heal-attention-kl 0"
        )
    return out[0], weights


SINK_MASS_MIN = 1e-5  # a row's missing probability mass below this is rounding, not an attention sink's share


def attention_kl(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """Mean over batch, heads and query positions of ``KL(teacher || student)`` between two layers' attention rows
    ``(batch, heads, q_len, kv_len)``. A row's missing mass (an attention sink's share, gpt-oss) is one more outcome
    where it exceeds :data:`SINK_MASS_MIN`; a row with no allowed key (all zeros in both) adds 0."""
    t, s = teacher.float(), student.float()
    t_rest, s_rest = (1 - t.sum(-1, keepdim=True)).clamp_min(0), (1 - s.sum(-1, keepdim=True)).clamp_min(0)
    t_rest = torch.where(t_rest > SINK_MASS_MIN, t_rest, torch.zeros_like(t_rest))
    t, s = torch.cat([t, t_rest], -1), torch.cat([s, s_rest], -1)
    tiny = torch.finfo(torch.float32).tiny
    return (torch.xlogy(t, t) - torch.xlogy(t, s.clamp_min(tiny))).sum(-1).mean()


@torch.no_grad()
def store_shared(attn: nn.Module, calls: list) -> None:
    """Run ``attn`` once on each of its recorded ``calls`` (in the fits' stream,
    :data:`~hf_qknorm.conversion.calibration.streaming.FIT`) where they hold a mapping the blocks share: what it
    stores there is then what its final parameters make (a fit's last step, or a trial's, or the parameters a
    rejected fit left behind, would be there otherwise), and a later layer reading it is fitted on the keys the
    written model has."""
    if any(isinstance(v, StreamMapping) for c in calls for v in (*c.args, *c.kwargs.values())):
        for call in calls:
            attention_output(attn, call)


def output_scale(targets: list[torch.Tensor]) -> float:
    """The mean square of the target outputs: the fit's errors are relative to it."""
    return max(sum(t.float().pow(2).sum().item() for t in targets) / max(1, sum(t.numel() for t in targets)), 1e-30)


@torch.no_grad()
def relative_error(
    attn: nn.Module, calls: list[BlockCall], targets: list[torch.Tensor], denom: float, overrides: dict | None = None
) -> float:
    total = sum((attention_output(attn, c, overrides) - t).float().pow(2).sum().item() for c, t in zip(calls, targets))
    return total / max(1, sum(t.numel() for t in targets)) / denom


class _Reparam:
    """``w0 * exp(theta)`` for weights, ``b0 + scale * theta`` for biases; ``theta`` starts at 0."""

    def __init__(self, params: dict[str, nn.Parameter]):
        self.base = {k: p.detach().clone() for k, p in params.items()}
        self.theta = {k: torch.zeros_like(p, requires_grad=True) for k, p in params.items()}
        self.scale = {}
        for k, p in self.base.items():
            if k.endswith(".bias"):
                w = self.base.get(k[: -len("bias")] + "weight")
                ref = w if w is not None else p
                self.scale[k] = max(ref.pow(2).mean().sqrt().item(), 1e-3)

    def values(self) -> dict[str, torch.Tensor]:
        out = {}
        for k, b in self.base.items():
            out[k] = b + self.scale[k] * self.theta[k] if k in self.scale else b * self.theta[k].exp()
        return out


def fit_attention(
    attn: nn.Module,
    calls: list[BlockCall],
    targets: list[torch.Tensor],
    *,
    steps: int,
    lr: float,
    seed: int = 0,
    start: dict | None = None,
    on_step=None,
) -> FitResult:
    """Fit the new norms of the patched ``attn`` (already set to the closed form) to ``targets``: the original
    attention layer's outputs for the recorded ``calls`` (one per calibration block). ``start``: other values of the
    norms (by name relative to ``attn``: identity, or the model's own per-head norms they replace), from which the
    fit starts instead when they do better than the closed form -- a ``qk_norm`` / ``rmsnorm`` conversion of a model
    with such norms starts from the original layer itself. Leaves ``attn`` with the best of these and the fit;
    ``on_step(step)`` is called after every step (progress)."""
    params = norm_parameters(attn)
    denom = output_scale(targets)
    error_cf = relative_error(attn, calls, targets, denom)
    best = error_cf
    if start and params:
        error_start = relative_error(attn, calls, targets, denom, start)
        if error_start <= error_cf:
            with torch.no_grad():
                for k, p in params.items():
                    p.copy_(start[k])
            best = error_start
    if steps <= 0 or not params:
        return FitResult(error_cf, best, False)
    rep = _Reparam(params)
    fit_output(attn, calls, targets, denom, list(rep.theta.values()), rep.values, steps, lr, seed, on_step)
    fitted = {k: v.detach() for k, v in rep.values().items()}
    error = relative_error(attn, calls, targets, denom, fitted)
    if not error < best:
        return FitResult(error_cf, best, False)
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(fitted[k])
    return FitResult(error_cf, error, True)


def fit_output(
    attn,
    calls,
    targets,
    denom: float,
    tensors: list,
    overrides,
    steps: int,
    lr: float,
    seed: int,
    on_step,
    lr_scales: list | None = None,
    teacher=None,
    kl_weight: float = 0.0,
):
    """The layer fit: :func:`~hf_qknorm.conversion.calibration.optim.cosine_adam` on ``tensors`` so that ``attn``'s
    output with the parameters ``overrides()`` (``None``: its own) matches ``targets``, relative to ``denom``; one
    recorded call per step, drawn with ``seed``. ``on_step(step)`` after each step. ``lr_scales`` (one per tensor;
    ``None``: all 1) multiplies each tensor's step size. ``teacher`` (``j -> attention probabilities`` of the
    original layer for call ``j``) with ``kl_weight > 0`` adds ``kl_weight`` x :func:`attention_kl` of ``attn``'s
    probabilities from the teacher's to each step's loss (attention-probability distillation)."""
    gen = torch.Generator().manual_seed(seed)
    distil = teacher is not None and kl_weight > 0

    def loss(step):
        j = int(torch.randint(0, len(calls), (1,), generator=gen))
        if distil:
            out, probs = attention_with_weights(attn, calls[j], overrides())
            error = (out - targets[j]).float().pow(2).mean() / denom
            return error + kl_weight * attention_kl(teacher(j), probs)
        return (attention_output(attn, calls[j], overrides()) - targets[j]).float().pow(2).mean() / denom

    tick = None if on_step is None else lambda step, _: on_step(step)
    cosine_adam(scaled_groups(tensors, lr, lr_scales), steps, loss, tick)

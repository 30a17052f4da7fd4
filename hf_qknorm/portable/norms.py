"""Per-head norm modules for queries, keys and values.

Every module normalises over the last dimension, ``head_dim``, and shares its parameters across heads (Wortsman et
al. 2023: head-dim parameters shared by all heads; Qwen3 uses the same layout). Inputs are ``(..., head_dim)`` -- in
the patched attention ``(batch, seq, heads, head_dim)`` -- and the norm sits **before** RoPE. Arithmetic runs in
float32 for half-precision inputs and the result is cast back, as Transformers' own RMSNorm does (float64 inputs stay
float64, so the float64 reference tests are exact).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .names import ROLES

_FULL = (torch.float32, torch.float64)  # dtypes the norms compute in as they are


def _acc(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: float32 for half precision and float32, float64 stays float64."""
    return torch.promote_types(x.dtype, torch.float32)


class HeadLayerNorm(nn.Module):
    """LayerNorm over ``head_dim`` with ``weight`` and ``bias`` of shape ``(head_dim,)`` (the paper's QK-norm)."""

    kind = "layernorm"
    # reduces over the last dimension only: hooks._normed may pass it the rows flat (not inherited); and on rows
    # ``(-1, head_dim)`` whose dtype its weight and bias (both in ``_parameters``) have, ``forward`` is exactly
    # ``torch.layer_norm(rows, (head_dim,), weight, bias, eps)`` cast back to that dtype: _normed makes that call
    rowwise = "layer_norm"

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.bias = nn.Parameter(torch.zeros(head_dim))
        self.eps = eps

    def initial_values(self) -> dict[str, float]:
        return {"weight": 1.0, "bias": 0.0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Decoding calls this for every layer at every token, where a microsecond is a percent of the step: the
        # parameters straight from ``_parameters`` (``nn.Module.__getattr__`` is slow; anything that keeps them
        # elsewhere, e.g. a parametrization, takes the attribute), ``torch.layer_norm`` rather than ``F.layer_norm``
        # (whose Python wrapper adds most of a microsecond; the binding honours ``__torch_function__`` alike)
        params = self._parameters
        weight, bias = params.get("weight"), params.get("bias")
        if weight is None or bias is None:
            weight, bias = self.weight, self.bias
        if weight.dtype == x.dtype and bias.dtype == x.dtype:
            # one ATen call: float32/float64 as they are; half precision too -- layer_norm computes its statistics
            # and the affine map in float32 inside and rounds once, as the casts around a float32 norm would (one
            # kernel launch instead of five on a GPU, where decoding pays for every launch; the result can differ
            # from the cast form in the last bit where the two kernels reduce in another order)
            y = torch.layer_norm(x, (x.shape[-1],), weight, bias, self.eps)
            return y if y.dtype == x.dtype else y.to(x.dtype)  # autocast runs layer_norm in float32
        acc = _acc(x)
        y = F.layer_norm(x.to(acc), (x.shape[-1],), weight.to(acc), bias.to(acc), self.eps)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class HeadRMSNorm(nn.Module):
    """RMSNorm over ``head_dim`` with ``weight`` of shape ``(head_dim,)``: the exact arithmetic of ``Qwen3RMSNorm``,
    so that a Llama with ``rmsnorm`` QK-norm is bit-for-bit a Qwen3 model."""

    kind = "rmsnorm"
    rowwise = True  # reduces over the last dimension only: hooks._normed may pass it the rows flat (not inherited)

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.variance_epsilon = eps

    @property
    def eps(self) -> float:
        return self.variance_epsilon

    @eps.setter
    def eps(self, value: float) -> None:
        self.variance_epsilon = value

    def initial_values(self) -> dict[str, float]:
        return {"weight": 1.0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x if dtype in _FULL else x.to(_acc(x))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * (h if dtype in _FULL else h.to(dtype))

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"


class HeadLpNorm(nn.Module):
    """``x / max(||x||_p, eps)`` over ``head_dim``, times an optional learnable scale.

    ``scale="logit"``: one scalar ``weight`` -- the learnable logit scale ``g`` that replaces ``1/sqrt(head_dim)``
    (Henry et al. 2020; López-Rubio et al. 2026). It sits on the query norm, so ``g * q_hat . k_hat`` is computed by
    any attention backend with ``scaling=1``.
    ``scale="channel"``: ``weight`` of shape ``(head_dim,)`` (used on values by ``qkv_norm``).
    ``scale=None``: no parameter (the key norm).
    """

    kind = "lp"
    rowwise = True  # reduces over the last dimension only: hooks._normed may pass it the rows flat (not inherited)

    def __init__(self, head_dim: int, p: float, eps: float, scale: str | None, init: float = 1.0):
        super().__init__()
        if scale not in (None, "logit", "channel"):
            raise ValueError(f"scale must be None, 'logit' or 'channel', got {scale!r}")
        self.p = float(p)
        self.eps = eps
        self.scale = scale
        self.initial_scale = float(init)
        if scale == "logit":
            self.weight = nn.Parameter(torch.full((1,), float(init)))
        elif scale == "channel":
            self.weight = nn.Parameter(torch.full((head_dim,), float(init)))
        else:
            self.register_parameter("weight", None)

    def initial_values(self) -> dict[str, float]:
        return {} if self.weight is None else {"weight": self.initial_scale}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, acc = x.dtype, _acc(x)
        x = x.to(acc)
        # ``||x||_p`` overflows for large p (|x|^64 passes float32's range at |x| > 4): scale by max|x| first, as the
        # Triton kernel does. ``x / max(||x||_p, eps) == u / max(||u||_p, eps / m)`` with ``u = x / m`` for any m > 0,
        # so the result does not depend on m and m carries no gradient.
        m = x.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(acc).tiny).detach()
        u = x / m
        y = u / torch.maximum(torch.linalg.vector_norm(u, ord=self.p, dim=-1, keepdim=True), self.eps / m)
        if self.weight is not None:
            y = y * self.weight.to(acc)
        return y.to(dtype)

    def extra_repr(self) -> str:
        return f"p={self.p}, eps={self.eps}, scale={self.scale}"


def henry_logit_scale(seq_len: int) -> float:
    """Henry et al. 2020's initial logit scale ``g0 = log2(L^2 - L)`` for training length ``L``."""
    seq_len = max(int(seq_len), 2)
    return math.log2(seq_len * seq_len - seq_len)


def make_norm(
    kind: str, role: str, head_dim: int, eps: float, p: float | None = None, logit_scale: float = 1.0
) -> nn.Module:
    """Build the norm for ``role`` in :data:`~.names.ROLES`.

    For ``layernorm``/``rmsnorm`` the three roles are the same module type. For ``l2``/``lp`` the query norm holds
    the learnable logit scale (initialised to ``logit_scale``), the key norm has no parameter and the value norm has
    a per-channel scale initialised to 1.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(map(repr, ROLES))}, got {role!r}")
    if kind == "layernorm":
        return HeadLayerNorm(head_dim, eps)
    if kind == "rmsnorm":
        return HeadRMSNorm(head_dim, eps)
    if kind in ("l2", "lp"):
        scale = {"q": "logit", "k": None, "v": "channel"}[role]
        return HeadLpNorm(head_dim, 2.0 if kind == "l2" else p, eps, scale, logit_scale if role == "q" else 1.0)
    raise ValueError(f"unknown norm {kind!r}; valid norms: 'layernorm', 'rmsnorm', 'l2', 'lp'")


NORM_CLASSES = (HeadLayerNorm, HeadRMSNorm, HeadLpNorm)


def initial_value(model: nn.Module, name: str) -> float:
    """The initial value of the norm parameter ``name`` (a state-dict name) of a patched model: the one rule for
    identity initialisation (weight 1, bias 0; the ``l2``/``lp`` logit scale), used by patching, loading and
    conversion alike."""
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if not isinstance(owner, NORM_CLASSES):
        raise ValueError(
            f"{name} is not a parameter of a norm added by hf_qknorm (its module is {type(owner).__name__})"
        )
    return owner.initial_values()[leaf]


@torch.no_grad()
def init_unloaded_norms(model: nn.Module) -> None:
    """Give every norm parameter of ``model`` that Transformers did not load from a checkpoint its initial value
    (:meth:`initial_values`: identity, or the ``l2``/``lp`` logit scale). Transformers marks what it loaded with
    ``_is_hf_initialized`` and initialises the rest with the family's ``_init_weights``, which does not know these
    modules: a missing logit scale would keep uninitialised memory."""
    for module in model.modules():
        if isinstance(module, NORM_CLASSES):
            for name, value in module.initial_values().items():
                param = getattr(module, name)
                if not getattr(param, "_is_hf_initialized", False):
                    param.fill_(value)

"""Per-head norms applied around the projections, so that Transformers' own attention forward runs unmodified.

A patched attention module keeps its upstream ``forward``. Its norms are applied by forward hooks on the
projections that feed it: the hook on ``q_proj`` receives the projection output ``(batch, seq, heads * head_dim)``,
views it as ``(batch, seq, heads, head_dim)``, applies ``attn.q_norm`` and hands the result back, so the upstream
forward splits heads, applies RoPE (after the norm, as QK-norm requires), updates the cache and calls the attention
backend exactly as it would for the unpatched model. GPT-2's fused ``c_attn`` gets one hook that normalises the
query, key (and value) thirds of its output. Families whose forward already calls ``self.q_norm``/``self.k_norm``
(Qwen3) need no hook for q and k: the new norm modules simply take the place of the old ones.

The norm is looked up on the attention module at call time (never captured), so a ``peft``
``ModulesToSaveWrapper`` placed around it is honoured. When ``peft`` (or anything else) replaces a hooked
projection -- LoRA wraps ``q_proj`` and keeps the original as ``base_layer`` -- the hook must move to the new
module, or the LoRA delta would be added after the norm. The attention module's class is therefore a thin subclass
(``QKNorm<Attention>``) whose ``__setattr__`` moves the hook whenever a hooked slot is reassigned; its ``forward``
checks that the attention backend can apply the module's cap, then calls the upstream forward.

This module imports nothing but ``torch`` and :mod:`.names`: it is also copied into exported folders
(``trust_remote_code``).
"""

from __future__ import annotations

import torch
from torch import nn

from .names import ATTN_IMPLEMENTATION, CLASS_PREFIX

# Attention implementations that read the cap a patched module carries (``module._qknorm_softcap``).
CAP_READING_BACKENDS = (ATTN_IMPLEMENTATION,)

_ATTENTION_CLASSES: dict[type, type] = {}


def _norm_heads(attn: nn.Module, role: str, x: torch.Tensor) -> torch.Tensor:
    """The scheme's norm for ``role`` over each head of ``x`` ``(..., heads * head_dim)``; returns the same shape."""
    norm = getattr(attn, attn.__dict__["_qknorm_norms"][role])
    return norm(x.view(*x.shape[:-1], -1, attn.__dict__["_qknorm_shape"][0])).view(x.shape)


def _fused(attn: nn.Module, roles: tuple[str, ...], output: torch.Tensor) -> torch.Tensor:
    """Normalise the parts named by ``roles`` of a fused q/k/v projection's output. ``concat``: ``[q | k | v]``
    with ``heads`` query and ``kv_heads`` key/value heads (GPT-2, Phi-3 under GQA, GPT-BigCode's multi-query);
    ``per_head``: ``[q_h k_h v_h]`` for each head (GPT-NeoX, Persimmon)."""
    head_dim, heads, kv_heads, layout = attn.__dict__["_qknorm_shape"]
    if layout == "per_head":
        per_head = output.view(*output.shape[:-1], -1, 3 * head_dim)
        parts = per_head.split(head_dim, dim=-1)
        normed = [_norm_role(attn, r, t) if r else t for r, t in zip(roles, parts)]
        return torch.cat(normed, dim=-1).view(output.shape)
    q_size = output.shape[-1] - 2 * kv_heads * head_dim
    parts = output.split([q_size, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return torch.cat([_norm_heads(attn, r, t) if r else t for r, t in zip(roles, parts)], dim=-1)


def _norm_role(attn: nn.Module, role: str, x: torch.Tensor) -> torch.Tensor:
    """The scheme's norm for ``role`` on ``x`` already shaped ``(..., head_dim)``."""
    return getattr(attn, attn.__dict__["_qknorm_norms"][role])(x)


def _projection_hook(slot: str, roles: tuple[str, ...]):
    """Forward hook for the module in ``slot`` (a projection, or a norm the model keeps over a whole projection):
    normalise the output's parts named by ``roles``.

    ``roles`` is one of ``("q",)``, ``("k",)``, ``("v",)`` for separate projections, or a triple such as
    ``("q", "k", "")`` for a fused projection (``""``: that part is left as it is)."""

    def hook(module, args, output):
        attn = module.__dict__.get("_qknorm_owner")
        # A stale hook (its module was replaced, e.g. it became a LoRA layer's ``base_layer``) does nothing.
        if attn is None or attn._modules.get(slot) is not module:
            return None
        if len(roles) == 1:
            return _norm_heads(attn, roles[0], output)
        return _fused(attn, roles, output)

    return hook


def hook_slots(family, roles: set[str]) -> dict[str, tuple[str, ...]]:
    """Which modules of an attention module need a hook, and for which roles: the fused projection (one hook for
    every role), else each role's projection -- or, where the model keeps its own norm over the whole projection
    (OLMo 2), that norm, whose output the scheme's per-head norm then takes. ``roles``: the roles whose norm is
    applied by a hook (``"q"``, ``"k"``, ``"v"``); a role whose norm replaces a native one needs none."""
    if family.qkv_proj is not None:
        return {family.qkv_proj: tuple(r if r in roles else "" for r in ("q", "k", "v"))} if roles else {}
    sources = {**family.projections, **family.kept}
    return {sources[r]: (r,) for r in ("q", "k", "v") if r in roles}


def _attach(attn: nn.Module, slot: str) -> None:
    """Hook the module now in ``slot`` (once), remembering its handle on the attention module."""
    module = attn._modules[slot]
    handles = attn.__dict__["_qknorm_handles"]
    if slot in handles and handles[slot][0] is module:
        return
    if slot in handles:
        handles[slot][1].remove()
    module.__dict__["_qknorm_owner"] = attn
    handle = module.register_forward_hook(_projection_hook(slot, attn.__dict__["_qknorm_slots"][slot]))
    handles[slot] = (module, handle)


def _setattr(self, name, value):
    nn.Module.__setattr__(self, name, value)
    if name in self.__dict__.get("_qknorm_slots", ()):  # a hooked projection was replaced (peft, merge, ...)
        _attach(self, name)


def check_cap_backend(impl) -> None:
    """Refuse to run a capped module through a backend that would drop its cap."""
    if impl not in CAP_READING_BACKENDS:
        raise ValueError(
            f"attention implementation {impl!r} cannot apply the softcap of this patched model "
            f"(it would be dropped silently); use {CAP_READING_BACKENDS[0]!r}: "
            f"model.set_attn_implementation({CAP_READING_BACKENDS[0]!r})"
        )


def attention_class(base: type) -> type:
    """``QKNorm<base>``: ``base`` with hook relocation on reassignment and the cap-backend check (made once)."""
    if base in _ATTENTION_CLASSES.values():
        return base
    if base not in _ATTENTION_CLASSES:

        def forward(self, *args, **kwargs):
            if self.__dict__.get("_qknorm_softcap") is not None:
                check_cap_backend(self.config._attn_implementation)
            return base.forward(self, *args, **kwargs)  # the upstream forward, unmodified

        cls = type(
            f"{CLASS_PREFIX}{base.__name__}",
            (base,),
            {"__setattr__": _setattr, "forward": forward, "__module__": __name__},
        )
        globals()[cls.__name__] = cls  # importable by name: pickling and copying work
        _ATTENTION_CLASSES[base] = cls
    return _ATTENTION_CLASSES[base]


def is_installed(attn: nn.Module) -> bool:
    """Whether ``attn`` is already a patched attention module."""
    return "_qknorm_slots" in attn.__dict__


def install(
    attn: nn.Module,
    slots: dict[str, tuple[str, ...]],
    norms: dict[str, str],
    shape: tuple[int, int, int, str | None],
    softcap: float | None,
    scaling: float | None,
) -> None:
    """Make ``attn`` a patched attention module: hooks on ``slots``, its cap, and (``l2``/``lp``) its scaling.

    ``norms``: role -> the attribute of ``attn`` holding that role's norm (already set); ``shape``: ``(head_dim,
    heads, kv_heads, fused layout)``."""
    if is_installed(attn):
        raise RuntimeError(f"{type(attn).__name__} is already patched; its norms would be applied twice")
    attn.__dict__["_qknorm_base_class"] = type(attn)
    attn.__class__ = attention_class(type(attn))
    attn.__dict__["_qknorm_slots"] = dict(slots)
    attn.__dict__["_qknorm_norms"] = dict(norms)
    attn.__dict__["_qknorm_shape"] = tuple(shape)
    attn.__dict__["_qknorm_handles"] = {}
    attn.__dict__["_qknorm_softcap"] = softcap
    if scaling is not None:  # the upstream forward passes ``scaling=self.scaling`` to the backend
        attn.__dict__["_qknorm_old_scaling"] = getattr(attn, "scaling", None)
        attn.scaling = scaling
    for slot in slots:
        _attach(attn, slot)


def uninstall(attn: nn.Module) -> None:
    """Undo :func:`install` (hooks, class, cap, scaling): a patch refused after installation leaves the module as it
    was. The norm modules are the caller's to remove."""
    for module, handle in attn.__dict__["_qknorm_handles"].values():
        handle.remove()
        module.__dict__.pop("_qknorm_owner", None)
    if "_qknorm_old_scaling" in attn.__dict__:
        attn.scaling = attn.__dict__["_qknorm_old_scaling"]
    attn.__class__ = attn.__dict__["_qknorm_base_class"]
    for key in [k for k in attn.__dict__ if k.startswith("_qknorm_")]:
        del attn.__dict__[key]

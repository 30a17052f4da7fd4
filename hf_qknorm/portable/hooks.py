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
    """``attn.<role>_norm`` over the last dim of ``x`` ``(..., heads * head_dim)``; returns the same shape."""
    norm = getattr(attn, f"{role}_norm")
    return norm(x.view(*x.shape[:-1], -1, attn.head_dim)).view(x.shape)


def _projection_hook(slot: str, roles: tuple[str, ...]):
    """Forward hook for the projection in ``slot``: normalise the output's parts named by ``roles``.

    ``roles`` is one of ``("q",)``, ``("k",)``, ``("v",)`` for separate projections, or a triple such as
    ``("q", "k", "")`` for a fused projection whose output is the concatenation of q, k and v (``""``: that part is
    left as it is)."""

    def hook(module, args, output):
        attn = module.__dict__.get("_qknorm_owner")
        # A stale hook (its module was replaced, e.g. it became a LoRA layer's ``base_layer``) does nothing.
        if attn is None or attn._modules.get(slot) is not module:
            return None
        if len(roles) == 1:
            return _norm_heads(attn, roles[0], output)
        parts = output.split(output.shape[-1] // len(roles), dim=-1)
        return torch.cat([_norm_heads(attn, r, t) if r else t for r, t in zip(roles, parts)], dim=-1)

    return hook


def hook_slots(fused: str | None, separate: dict[str, str], roles: set[str]) -> dict[str, tuple[str, ...]]:
    """Which projection slots need a hook, and for which roles.

    ``fused``: the fused q/k/v projection's attribute (GPT-2's ``c_attn``) or ``None``; ``separate``: role ->
    attribute for separate projections; ``roles``: the roles whose norm is applied by a hook (``"q"``, ``"k"``,
    ``"v"``)."""
    if fused is not None:
        return {fused: tuple(r if r in roles else "" for r in ("q", "k", "v"))} if roles else {}
    return {separate[r]: (r,) for r in ("q", "k", "v") if r in roles}


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


def install(attn: nn.Module, slots: dict[str, tuple[str, ...]], softcap: float | None, scaling: float | None) -> None:
    """Make ``attn`` a patched attention module: hooks on ``slots``, its cap, and (``l2``/``lp``) its scaling.

    The norm modules themselves must already be attributes of ``attn`` (``q_norm``, ``k_norm``, ``v_norm``)."""
    if is_installed(attn):
        raise RuntimeError(f"{type(attn).__name__} is already patched; its norms would be applied twice")
    attn.__class__ = attention_class(type(attn))
    attn.__dict__["_qknorm_slots"] = dict(slots)
    attn.__dict__["_qknorm_handles"] = {}
    attn.__dict__["_qknorm_softcap"] = softcap
    if scaling is not None:  # the upstream forward passes ``scaling=self.scaling`` to the backend
        attn.scaling = scaling
    for slot in slots:
        _attach(attn, slot)

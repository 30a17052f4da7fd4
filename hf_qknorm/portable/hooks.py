"""Per-head norms applied at the projections, so that Transformers' own attention forward runs unmodified.

A patched attention module keeps its upstream ``forward``. Its norms are applied to the output of the projections
that feed it: ``q_proj``'s output ``(batch, seq, heads * head_dim)`` is viewed as ``(batch, seq, heads, head_dim)``
(or, where no hook can see the difference, as ``(-1, head_dim)`` rows: :func:`_normed`), ``attn.q_norm`` applied
and the result handed on, so the upstream forward splits heads, applies RoPE (after the norm,
as QK-norm requires), updates the cache and calls the attention backend exactly as it would for the unpatched model.
GPT-2's fused ``c_attn`` normalises the query, key (and value) thirds of its output. Families whose forward already
calls ``self.q_norm``/``self.k_norm`` (Qwen3) need nothing for q and k: the new norm modules simply take the place of
the old ones.

How the norm reaches the projection's output, two ways with one result:

- the projection's class becomes a thin subclass (``QKNorm<Linear>``, made once per class) whose ``forward`` is the
  class's own followed by the norms. This is the default: decoding calls every projection of every layer at every
  token, and a forward hook makes each of those calls take ``nn.Module``'s slow path, a visible share of a
  host-bound model's decoding step (benchmarks/results/tuning.md);
- a forward hook, where a class swap would be bypassed or come too early: a module whose ``forward`` was replaced
  on the instance (accelerate's offload hooks keep the class's forward and call it themselves), and tensor
  parallelism, whose output hook must turn the ``DTensor`` into a local tensor before the norm sees it
  (:func:`use_forward_hooks`).

The norm is looked up on the attention module at call time (never captured), so a ``peft``
``ModulesToSaveWrapper`` placed around it is honoured. When ``peft`` (or anything else) replaces a projection --
LoRA wraps ``q_proj`` and keeps the original as ``base_layer`` -- the norm must move to the new module, or the LoRA
delta would be added after the norm. The attention module's class is therefore a thin subclass
(``QKNorm<Attention>``) whose ``__setattr__`` moves the norm whenever a normalised slot is reassigned; a capped
module's (``QKNormCapped<Attention>``, a subclass of it) also has a ``forward``, which checks that the attention
backend can apply the module's cap, then calls the upstream forward.

This module imports nothing but the standard library, ``torch`` and :mod:`.names`: it is also copied into exported
folders (``trust_remote_code``).
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from .names import ATTN_IMPLEMENTATION, CLASS_PREFIX, ROLES

# Attention implementations that read the cap a patched module carries (``module._qknorm_softcap``).
CAP_READING_BACKENDS = (ATTN_IMPLEMENTATION,)

_ATTENTION_CLASSES: dict[tuple[type, bool], type] = {}  # (upstream class, capped) -> its patched class
# Held while a patched class is made and stored: two threads patching models of one family at once must get the same
# class (a module of a class that lost the race would no longer count as patched, nor unpatch).
_CLASSES_LOCK = threading.RLock()


# torch's process-wide module hooks: while any is set, a module call must go through ``nn.Module.__call__``
_MODULE = torch.nn.modules.module
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                 "_global_backward_hooks")  # fmt: skip
_DIRECT_CALLS = all(isinstance(getattr(_MODULE, name, None), dict) for name in _GLOBAL_HOOKS)


def _hooked(module: nn.Module) -> bool:
    """Whether a call of ``module`` must go through ``nn.Module.__call__``: a hook on it, or a process-wide one."""
    return not _DIRECT_CALLS or bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or _MODULE._global_forward_pre_hooks
        or _MODULE._global_forward_hooks
        or _MODULE._global_backward_pre_hooks
        or _MODULE._global_backward_hooks
    )


def _call(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``. When no hook is registered on the module or process-wide, ``nn.Module.__call__`` would only call
    ``module.forward``, so it is called directly: decoding calls the norms of every layer at every token, and the
    call machinery costs a large fraction of what a norm on a few heads takes (benchmarks/results/tuning.md). Any hook
    (FSDP, a user's) takes the full call."""
    return module(x) if _hooked(module) else module.forward(x)


def _norm_heads(attn: nn.Module, role: str, x: torch.Tensor) -> torch.Tensor:
    """The scheme's norm for ``role`` over each head of ``x`` ``(..., heads * head_dim)``; returns the same shape."""
    state = attn.__dict__
    norm = attn._modules[state["_qknorm_norms"][role]]
    # flatten, not view(x.shape): the shape object costs a microsecond per call when decoding
    return _call(norm, x.unflatten(-1, (-1, state["_qknorm_shape"][0]))).flatten(-2)


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
    return _call(attn._modules[attn.__dict__["_qknorm_norms"][role]], x)


# A slot the plugin fills (hf_qknorm.attention.fused_norms; this folder imports no kernels): ``FUSED_NORM(norm, rows)``
# is the norm of the rows ``(-1, head_dim)`` through a fused kernel, or None where the norm's own forward runs.
FUSED_NORM = None


def _normed(module: nn.Module, output: torch.Tensor) -> torch.Tensor:
    """``output`` of the projection ``module`` with the norms of the attention module that owns it applied to the
    parts its slot names: ``("q",)``, ``("k",)``, ``("v",)`` for separate projections, or a triple such as
    ``("q", "k", "")`` for a fused projection (``""``: that part is left as it is).

    Decoding runs this for every normalised projection of every layer at every token, so the common case -- one
    role, a norm whose own class declares ``rowwise`` (it reduces over the last dimension only: this package's),
    no hook on it, a contiguous output -- is one frame: the norm on the rows ``(-1, head_dim)``, the same values as
    on ``(batch, seq, heads, head_dim)``; a norm that declares ``rowwise = "layer_norm"`` (:class:`HeadLayerNorm`)
    is that one ``torch.layer_norm`` call, made here, without the norm's own frame. Otherwise, and whenever a hook
    or a ``forward`` replaced on the norm instance could see its input, the norm is called on the per-head view."""
    state = module.__dict__
    attn = state.get("_qknorm_owner")
    # A stale module (replaced, e.g. it became a LoRA layer's ``base_layer``, or the patch was undone) does nothing.
    if attn is None:
        return output
    slot, name, head_dim = state["_qknorm_plan"]  # made by _attach; ``name`` None for a fused projection
    modules = attn.__dict__["_modules"]  # instance dicts, not attributes: nn.Module's __getattr__ slows each lookup
    if modules.get(slot) is not module:
        return output
    if name is None:
        return _fused(attn, attn.__dict__["_qknorm_slots"][slot], output)
    norm = modules[name]
    rows = _rowwise(norm)
    # a width that is not whole heads (a misconfigured or oddly sharded projection) takes unflatten, which refuses it
    if rows and output.is_contiguous() and output.size(-1) % head_dim == 0:
        flat = output.view(-1, head_dim)
        if FUSED_NORM is not None:  # the plugin's fused kernel (hf_qknorm.attention.fused_norms), where it applies
            normed = FUSED_NORM(norm, flat)
            if normed is not None:
                return normed.view_as(output)
        if rows == "layer_norm":
            params = _layer_norm_params(norm, output.dtype)
            if params is not None:
                return _layer_norm(flat, head_dim, params).view_as(output)
        return norm.forward(flat).view_as(output)
    # unflatten/flatten, not view(x.shape): the shape object costs a microsecond per call when decoding
    return _call(norm, output.unflatten(-1, (-1, head_dim))).flatten(-2)


def _rowwise(norm: nn.Module):
    """``norm``'s class's own ``rowwise`` declaration where it may be called on any rows of heads, by its
    ``forward`` without ``nn.Module.__call__``: no hook on it or process-wide, no ``forward`` on the instance, not
    compiling; else False. The class's own declaration, not an inherited one: a subclass may override ``forward``
    and look at the heads, and so may a ``forward`` replaced on the instance (accelerate's hooks); a compiled graph
    has no per-call cost to save, and Dynamo refuses a class's ``__dict__`` once it was modified."""
    if torch.compiler.is_compiling():  # never read the class dict under Dynamo
        return False
    rows = type(norm).__dict__.get("rowwise")
    own = norm.__dict__
    # not _hooked(norm), without its frame: decoding pays for every frame here
    if not rows or "forward" in own or not _DIRECT_CALLS:
        return False
    if (
        own["_forward_hooks"]
        or own["_forward_pre_hooks"]
        or own["_backward_hooks"]
        or own["_backward_pre_hooks"]
        or _MODULE._global_forward_pre_hooks
        or _MODULE._global_forward_hooks
        or _MODULE._global_backward_pre_hooks
        or _MODULE._global_backward_hooks
    ):
        return False
    return rows


def _layer_norm_params(norm: nn.Module, dtype: torch.dtype):
    """``(weight, bias, eps)`` of a ``rowwise = "layer_norm"`` norm whose ``forward`` is one ``torch.layer_norm``
    call on input of ``dtype``: its parameters its own and of that dtype; else None."""
    params = norm.__dict__["_parameters"]
    weight, bias = params.get("weight"), params.get("bias")
    if weight is None or bias is None or weight.dtype != dtype or bias.dtype != dtype:
        return None
    return weight, bias, norm.eps


def _layer_norm(x: torch.Tensor, head_dim: int, params) -> torch.Tensor:
    """The norm's ``forward`` on ``x`` (last dimension ``head_dim``), from :func:`_layer_norm_params`."""
    normed = torch.layer_norm(x, (head_dim,), *params)
    return normed if normed.dtype == x.dtype else normed.to(x.dtype)  # autocast runs layer_norm in float32


def _projection_hook(module, args, output):
    """The forward-hook form of :func:`_normed` (see the module docstring for when it is used)."""
    return _normed(module, output)


_PROJECTION_CLASSES: dict[type, type] = {}
_LINEAR_FORWARD = nn.Linear.forward
_F = torch.nn.functional  # ``F.linear`` looked up per call, as ``nn.Linear.forward`` does (a replaced one is honoured)


def projection_class(base: type) -> type:
    """``QKNorm<base>``: ``base`` whose ``forward`` is followed by the owning attention module's norms (made once;
    importable from this module by name, so patched models copy and pickle)."""
    made = _PROJECTION_CLASSES.get(base)
    if made is not None:
        return made
    with _CLASSES_LOCK:
        return _make_projection_class(base)


def _make_projection_class(base: type) -> type:
    if base in _PROJECTION_CLASSES.values():
        return base
    if base not in _PROJECTION_CLASSES:
        if base is nn.Linear:

            def forward(self, input):
                # ``nn.Linear.forward``, ``F.linear(input, self.weight, self.bias)``, with the parameters read from
                # ``_parameters`` (``nn.Module.__getattr__`` and the extra frame cost a microsecond or two per
                # projection per token when decoding); a parameter kept elsewhere (a parametrization) or a replaced
                # ``nn.Linear.forward`` takes the call as it is
                params = self._parameters
                weight = params.get("weight")
                if weight is None or "bias" not in params or nn.Linear.forward is not _LINEAR_FORWARD:
                    return _normed(self, base.forward(self, input))
                return _normed(self, _F.linear(input, weight, params["bias"]))

        else:

            def forward(self, *args, **kwargs):
                return _normed(self, base.forward(self, *args, **kwargs))

        name = f"{CLASS_PREFIX}{base.__name__}Projection"
        if name in globals():  # another class of the same name (torch's Linear, peft's LoRA Linear)
            name = f"{CLASS_PREFIX}{base.__module__.replace('.', '_')}_{base.__name__}Projection"
        cls = type(name, (base,), {"forward": forward, "__module__": __name__, "__qualname__": name})
        globals()[name] = cls
        _PROJECTION_CLASSES[base] = cls
    return _PROJECTION_CLASSES[base]


def hook_slots(family, roles: set[str]) -> dict[str, tuple[str, ...]]:
    """Which modules of an attention module need a hook, and for which roles: the fused projection (one hook for
    every role), else each role's projection -- or, where the model keeps its own norm over the whole projection
    (OLMo 2), that norm, whose output the scheme's per-head norm then takes. ``roles``: the roles whose norm is
    applied by a hook (``"q"``, ``"k"``, ``"v"``); a role whose norm replaces a native one needs none."""
    if family.qkv_proj is not None:
        return {family.qkv_proj: tuple(r if r in roles else "" for r in ROLES)} if roles else {}
    sources = {**family.projections, **family.kept}
    return {sources[r]: (r,) for r in ROLES if r in roles}


def _attach(attn: nn.Module, slot: str) -> None:
    """Make the module now in ``slot`` apply the norms (once): by its class, or by a forward hook where the module's
    ``forward`` is replaced on the instance or the attention module uses hooks (:func:`use_forward_hooks`)."""
    module = attn._modules[slot]
    sites = attn.__dict__["_qknorm_handles"]  # slot -> (module, forward hook handle or None for a class swap)
    if slot in sites and sites[slot][0] is module:
        return
    if slot in sites:
        _detach(attn, slot)
    module.__dict__["_qknorm_owner"] = attn
    # what _normed needs at every call, looked up once: the slot, the role's norm attribute (None: a fused projection,
    # several roles) and head_dim; the attention module's slots, norms and shape never change once installed
    roles = attn.__dict__["_qknorm_slots"][slot]
    name = attn.__dict__["_qknorm_norms"][roles[0]] if len(roles) == 1 else None
    module.__dict__["_qknorm_plan"] = (slot, name, attn.__dict__["_qknorm_shape"][0])
    if attn.__dict__.get("_qknorm_use_hooks") or "forward" in module.__dict__:
        sites[slot] = (module, module.register_forward_hook(_projection_hook))
    else:
        module.__class__ = projection_class(type(module))
        sites[slot] = (module, None)


def _detach(attn: nn.Module, slot: str) -> None:
    """Stop the module recorded for ``slot`` from applying the norms: its hook removed, or its class restored."""
    module, handle = attn.__dict__["_qknorm_handles"].pop(slot)
    if handle is not None:
        handle.remove()
    elif type(module) in _PROJECTION_CLASSES.values():
        module.__class__ = type(module).__bases__[0]
    module.__dict__.pop("_qknorm_owner", None)
    module.__dict__.pop("_qknorm_plan", None)


def use_forward_hooks(attn: nn.Module) -> None:
    """Apply ``attn``'s norms (if it is patched) by forward hooks from now on, registered after every hook its
    projections have now: tensor parallelism adds output hooks that turn the projection's ``DTensor`` into the local
    tensor the norm must see."""
    if not is_installed(attn):  # an unpatched module: nothing to apply
        return
    attn.__dict__["_qknorm_use_hooks"] = True
    for slot in list(attn.__dict__["_qknorm_handles"]):
        _detach(attn, slot)
        _attach(attn, slot)


def _setattr(self, name, value):
    nn.Module.__setattr__(self, name, value)
    if name in self.__dict__.get("_qknorm_slots", ()):  # a normalised projection was replaced (peft, merge, ...)
        _attach(self, name)


_PLAIN_GETTER: dict[type, bool] = {}


def _attn_implementation(config) -> str | None:
    """``config._attn_implementation``, read from the instance where Transformers' own property reads it (the
    property costs three microseconds, per layer per token when decoding: the config's ``__getattribute__`` runs
    for every attribute read, ``__dict__`` included, hence ``object.__getattribute__``); through the attribute for a
    config class whose getter is another."""
    cls = type(config)
    plain = _PLAIN_GETTER.get(cls)
    if plain is None:  # the class that defines the property: Transformers' base config class, or another
        owner = next((c for c in cls.__mro__ if "_attn_implementation" in c.__dict__), None)
        plain = _PLAIN_GETTER[cls] = owner is not None and owner.__module__ == "transformers.configuration_utils"
    if plain and not torch.compiler.is_compiling():  # Dynamo does not trace ``object.__getattribute__``
        state = object.__getattribute__(config, "__dict__")
        if "_attn_implementation_internal" in state:
            return state["_attn_implementation_internal"]
    return config._attn_implementation


def check_cap_backend(impl) -> None:
    """Refuse to run a capped module through a backend that would drop its cap."""
    if impl not in CAP_READING_BACKENDS:
        raise ValueError(
            f"attention implementation {impl!r} cannot apply the softcap of this patched model "
            f"(it would be dropped silently); use {CAP_READING_BACKENDS[0]!r}: "
            f"model.set_attn_implementation({CAP_READING_BACKENDS[0]!r})"
        )


def attention_class(base: type, capped: bool) -> type:
    """``QKNorm<base>``: ``base`` with hook relocation on reassignment; ``QKNormCapped<base>``, its subclass for a
    capped module, also checks at every call that the attention backend applies the cap (made once each). An
    uncapped module has no check to make, and its class no ``forward`` of its own: a frame per layer per token less
    when decoding."""
    made = _ATTENTION_CLASSES.get((base, capped))
    if made is not None:
        return made
    with _CLASSES_LOCK:
        return _make_attention_class(base, capped)


def _make_attention_class(base: type, capped: bool) -> type:
    if base in _ATTENTION_CLASSES.values():
        return base
    if (base, False) not in _ATTENTION_CLASSES:
        body = {"__setattr__": _setattr, "__module__": __name__}
        cls = type(f"{CLASS_PREFIX}{base.__name__}", (base,), body)
        globals()[cls.__name__] = cls  # importable by name: pickling and copying work
        _ATTENTION_CLASSES[base, False] = cls
    if capped and (base, True) not in _ATTENTION_CLASSES:

        def forward(self, *args, **kwargs):
            if self.__dict__.get("_qknorm_softcap") is not None:
                check_cap_backend(_attn_implementation(self.config))
            return base.forward(self, *args, **kwargs)  # the upstream forward, unmodified

        name = f"{CLASS_PREFIX}Capped{base.__name__}"
        cls = type(name, (_ATTENTION_CLASSES[base, False],), {"forward": forward, "__module__": __name__})
        globals()[name] = cls
        _ATTENTION_CLASSES[base, True] = cls
    return _ATTENTION_CLASSES[base, capped]


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
    """Make ``attn`` a patched attention module: norms at ``slots``, its cap, and (``l2``/``lp``) its scaling.

    ``norms``: role -> the attribute of ``attn`` holding that role's norm (already set); ``shape``: ``(head_dim,
    heads, kv_heads, fused layout)``."""
    if is_installed(attn):
        raise RuntimeError(f"{type(attn).__name__} is already patched; its norms would be applied twice")
    attn.__dict__["_qknorm_base_class"] = type(attn)
    attn.__class__ = attention_class(type(attn), capped=softcap is not None)
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
    """Undo :func:`install` (norms at the projections, class, cap, scaling): a patch refused after installation
    leaves the module as it was. The norm modules are the caller's to remove."""
    for slot in list(attn.__dict__["_qknorm_handles"]):
        _detach(attn, slot)
    if "_qknorm_old_scaling" in attn.__dict__:
        attn.scaling = attn.__dict__["_qknorm_old_scaling"]
    attn.__class__ = attn.__dict__["_qknorm_base_class"]
    for key in [k for k in attn.__dict__ if k.startswith("_qknorm_")]:
        del attn.__dict__[key]

"""Where things are in a model: the one ``unwrap``, the family of a model, its decoder blocks and attention modules.

Everything that needs to find the Transformers model inside a wrapper, or its attention modules, goes through here
(patching, the monitor, Q/K learning rates, QK-Clip, LoRA set-up, the verifier), so wrappers are handled the same way
everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .families import Family, family_of_model, heads_of


def unwrap(model: nn.Module) -> nn.Module:
    """The Transformers model inside ``peft``, ``torch.compile``, DDP / DataParallel / FSDP(1) / DeepSpeed wrappers
    (any nesting), or the model itself. Raises ``TypeError`` when no model with a ``config`` is found."""
    inner = model
    for _ in range(16):
        if callable(getattr(inner, "get_base_model", None)):  # peft (before ``config``: peft forwards attributes)
            inner = inner.get_base_model()
        elif isinstance(getattr(inner, "_orig_mod", None), nn.Module):  # torch.compile
            inner = inner._orig_mod
        elif not hasattr(inner, "config") and isinstance(getattr(inner, "module", None), nn.Module):  # DDP & co.
            inner = inner.module
        else:
            break
    if not isinstance(inner, nn.Module) or getattr(inner, "config", None) is None:
        raise TypeError(
            f"expected a Transformers model (or one wrapped by peft, DDP, FSDP or torch.compile), "
            f"got {type(model).__name__}"
        )
    return inner


def family_of(model: nn.Module) -> Family:
    """The family of a (possibly patched, possibly wrapped) model, derived from its structure."""
    return family_of_model(unwrap(model))


def find_layers(model: nn.Module, family: Family) -> nn.ModuleList:
    """The decoder blocks: at the family's path from a head model (``model.layers``), from the bare base model
    (``layers``), or -- for heads that name their base model otherwise (``LlamaForQuestionAnswering.transformer``)
    -- the one ``ModuleList`` of blocks that hold the family's attention attribute."""
    path = family.layers.split(".")
    for candidate in (path, path[1:]):
        obj = model
        for name in candidate:
            obj = getattr(obj, name, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList):
            return obj
    found = [
        m
        for m in model.modules()
        if isinstance(m, nn.ModuleList) and len(m) and all(hasattr(block, family.attention) for block in m)
    ]
    if len(found) == 1:
        return found[0]
    raise ValueError(
        f"could not find the decoder blocks of this {family.model_type} model at "
        f"{family.layers!r} (model class {type(model).__name__})"
    )


def attention_modules(model: nn.Module) -> tuple[Family, list[nn.Module]]:
    """The family and every attention module of ``model`` (wrapped or not), in layer order."""
    inner = unwrap(model)
    family = family_of_model(inner)
    return family, [getattr(block, family.attention) for block in find_layers(inner, family)]


@dataclass(frozen=True)
class AttentionSite:
    """One attention module of a model: its layer index, the module and the family facts that describe it."""

    index: int
    module: nn.Module
    family: Family

    @property
    def patched(self) -> bool:
        """The module carries a scheme (norms and/or a cap) installed by :func:`hf_qknorm.patch_model`."""
        return "_qknorm_slots" in self.module.__dict__

    @property
    def backend(self) -> str | None:
        """The attention implementation the module runs on now."""
        return getattr(self.module.config, "_attn_implementation", None)


def num_heads(attn: nn.Module, config) -> tuple[int, int]:
    """``(query heads, key/value heads)`` of an attention module (the whole model's, not one rank's share)."""
    return heads_of(attn, config)


def attention_sites(model: nn.Module) -> list[AttentionSite]:
    """Every attention module of ``model`` (wrapped or not), in layer order, found through the family table."""
    family, modules = attention_modules(model)
    return [AttentionSite(i, module, family) for i, module in enumerate(modules)]


def upstream_class(attn: nn.Module) -> type:
    """The Transformers class of an attention module (behind the ``QKNorm<Attention>`` subclass of a patched one)."""
    return next(c for c in type(attn).__mro__ if not c.__module__.startswith(("hf_qknorm", "transformers_modules")))


def rotary_function(attn: nn.Module):
    """The ``apply_rotary_pos_emb(q, k, cos, sin)`` of an attention module's own modelling file: what its forward
    calls between the projections and the backend (listed in :data:`hf_qknorm.upstream.RELIANCES`)."""
    import sys

    return sys.modules[upstream_class(attn).__module__].apply_rotary_pos_emb


def norm_module(attn: nn.Module, family: Family, role: str) -> nn.Module | None:
    """The q/k/v norm of an attention module for ``role``: the scheme's on a patched module (wherever it lives:
    ``q_norm``, a native slot such as Persimmon's ``q_layernorm``, or ``qknorm_q_norm`` beside a kept norm), else the
    model's own per-head norm, else ``None``."""
    slots = attn.__dict__.get("_qknorm_norms")
    name = slots.get(role) if slots is not None else family.native.get(role)
    return attn._modules.get(name) if name else None

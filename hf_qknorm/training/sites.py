"""The attention modules of a model, as the training helpers see them (monitor, Q/K learning rates, QK-Clip, LoRA).

Found through the family table (:mod:`hf_qknorm.modeling.layout`), never by model class, for any supported model:
patched or not, wrapped by ``peft``, DDP or ``torch.compile``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..modeling.families import Family
from ..modeling.layout import attention_modules, unwrap


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


def attention_sites(model: nn.Module) -> list[AttentionSite]:
    """Every attention module of ``model``, in layer order, found through :mod:`hf_qknorm.modeling.families`."""
    family, modules = attention_modules(model)
    return [AttentionSite(i, module, family) for i, module in enumerate(modules)]


def num_heads(attn: nn.Module, config) -> tuple[int, int]:
    """``(query heads, key/value heads)`` of an attention module."""
    heads = getattr(config, "num_attention_heads", None) or getattr(attn, "num_heads")
    kv = getattr(config, "num_key_value_heads", None) or heads
    return int(heads), int(kv)


__all__ = ["AttentionSite", "attention_sites", "num_heads", "unwrap"]

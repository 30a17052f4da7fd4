"""Training integration: the attention-logit monitor, Q/K learning-rate control and LoRA helpers, in one place.

The pieces live in their own modules -- :mod:`hf_qknorm.training.monitor` (``QKMonitor``, ``QKMonitorCallback``),
:mod:`hf_qknorm.training.qk_lr` (``QKLearningRate``, ``QKLearningRateCallback``, ``qk_param_groups``) and
:mod:`hf_qknorm.training.lora` (``lora_config``, ``prepare_lora``) -- and share the helpers below, which find the
attention modules of any supported model (patched or not, wrapped by ``peft``, DDP or ``torch.compile``) through the
family table, never by model class.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..modeling.families import Family, get_family
from ..modeling.classes import PREFIX


def unwrap_model(model: nn.Module) -> nn.Module:
    """The Transformers model inside ``torch.compile``, DDP / FSDP(1) and ``peft`` wrappers (or the model itself)."""
    for _ in range(8):
        if hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
        elif type(model).__name__ in ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel"):
            model = model.module
        elif callable(getattr(model, "get_base_model", None)):  # peft
            model = model.get_base_model()
        else:
            break
    return model


def family_of(model: nn.Module) -> Family:
    """The family-table row of a (possibly patched, possibly wrapped) model."""
    model_type = str(getattr(unwrap_model(model).config, "model_type", ""))
    return get_family(model_type[len(PREFIX):] if model_type.startswith(PREFIX) else model_type)


@dataclass(frozen=True)
class AttentionSite:
    """One attention module of a model: its layer index, the module and the family facts that describe it."""

    index: int
    module: nn.Module
    family: Family

    @property
    def patched(self) -> bool:
        return hasattr(self.module, "_qknorm")


def attention_sites(model: nn.Module) -> list[AttentionSite]:
    """Every attention module of ``model``, in layer order, found through :mod:`hf_qknorm.modeling.families`."""
    from ..modeling.patch import _find_layers

    inner = unwrap_model(model)
    family = family_of(inner)
    return [AttentionSite(i, getattr(block, family.attention), family)
            for i, block in enumerate(_find_layers(inner, family))]


def num_heads(attn: nn.Module, config) -> tuple[int, int]:
    """``(query heads, key/value heads)`` of an attention module."""
    heads = getattr(config, "num_attention_heads", None) or getattr(attn, "num_heads")
    kv = getattr(config, "num_key_value_heads", None) or heads
    return int(heads), int(kv)


# The public names of the split modules, importable from here too (lazily: those modules import this one).
_EXPORTS = {
    "QKMonitor": "monitor", "QKMonitorCallback": "monitor", "attention_stats": "monitor",
    "QKLearningRate": "qk_lr", "QKLearningRateCallback": "qk_lr", "qk_param_groups": "qk_lr",
    "lora_config": "peft_utils", "prepare_lora": "peft_utils",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AttentionSite", "attention_sites", "family_of", "num_heads", "unwrap_model", *_EXPORTS]

"""The attention modules of a model, as the training helpers see them (monitor, Q/K learning rates, QK-Clip, LoRA).

Found through the family table (:mod:`hf_qknorm.modeling.layout`), never by model class, for any supported model:
patched or not, wrapped by ``peft``, DDP or ``torch.compile``.
"""

from __future__ import annotations

from torch import nn

from ..modeling.layout import AttentionSite, attention_sites, unwrap


def num_heads(attn: nn.Module, config) -> tuple[int, int]:
    """``(query heads, key/value heads)`` of an attention module."""
    heads = getattr(config, "num_attention_heads", None) or getattr(attn, "num_heads")
    kv = getattr(config, "num_key_value_heads", None) or heads
    return int(heads), int(kv)


__all__ = ["AttentionSite", "attention_sites", "num_heads", "unwrap"]

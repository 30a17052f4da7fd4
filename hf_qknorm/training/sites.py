"""The attention modules of a model, as the training helpers see them (monitor, Q/K learning rates, QK-Clip, LoRA).

Found through the family table (:mod:`hf_qknorm.portable.layout`), never by model class, for any supported model:
patched or not, wrapped by ``peft``, DDP or ``torch.compile``.
"""

from __future__ import annotations

from ..portable.layout import AttentionSite, attention_sites, num_heads, unwrap

__all__ = ["AttentionSite", "attention_sites", "num_heads", "unwrap"]

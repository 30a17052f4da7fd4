"""Which checkpoint tensors make each parameter of the model: the names a checkpoint stores and the names the model
loads them under are not always the same.

Transformers renames some checkpoint keys on loading (GPT-NeoX's ``embed_out`` is the model's ``lm_head``; a
checkpoint saved without the base-model prefix) and fuses others (a mixture of experts stores ``experts.0.w1``,
``experts.1.w1``, ... which the model holds as one ``experts.gate_up_proj``), and reverses both on saving. Its own
rules for a model (``transformers.conversion_mapping.get_model_conversion_mapping``, applied by
``transformers.core_model_loading.rename_source_key`` and the converters' own operations: what its loader calls;
tests/conversion/test_convert_every_type.py fails when they change, through the streamed perplexities of mixture of
experts models) are read here once per conversion, so that the streamed conversion reads every parameter the way
``from_pretrained`` would -- one block at a time -- and writes the checkpoint back in the source's own layout, as
``save_pretrained`` would. A fusion by an operation other than stacking and concatenating is refused in one line,
naming it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

# Transformers' operations a fused parameter may be made with: each stacks or concatenates the checkpoint's tensors.
FUSING_OPERATIONS = ("MergeModulelist", "Concatenate")


def _natural(key: str):
    """Sort key that orders ``experts.10`` after ``experts.9`` (the order Transformers stacks experts in)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


@dataclass
class Fused:
    """A model parameter made from several checkpoint tensors: ``sources`` (pattern -> keys, in order) through the
    converter's operations."""

    converter: object
    sources: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class KeyMap:
    """Model parameter name -> checkpoint key (``direct``) or :class:`Fused` tensors (``fused``)."""

    direct: dict[str, str] = field(default_factory=dict)
    fused: dict[str, Fused] = field(default_factory=dict)
    checkpoint: dict[str, str] = field(default_factory=dict)  # checkpoint key -> model name (direct ones)

    def __contains__(self, name: str) -> bool:
        return name in self.direct or name in self.fused


def key_map(model, checkpoint_keys) -> KeyMap:
    """How each parameter of ``model`` (a skeleton of the source's model, any device) is read from a checkpoint
    holding ``checkpoint_keys``, by Transformers' own renaming and fusing rules for the model. Raises
    ``UnsupportedModelError`` for a fused parameter made by an operation other than :data:`FUSING_OPERATIONS`."""
    from ..portable.families import UnsupportedModelError, base_model_type

    renamings, converters = _transforms(model)
    by_pattern = {pattern: conv for conv in converters for pattern in conv.source_patterns}
    meta = model.state_dict()
    out = KeyMap()
    for key in sorted(checkpoint_keys, key=_natural):
        name, pattern = _rename(key, renamings, converters, model, meta)
        if pattern is None:
            if name in meta:
                out.direct.setdefault(name, key)
                out.checkpoint[key] = name
            continue
        converter = by_pattern[pattern]
        ops = [type(op).__name__ for op in getattr(converter, "operations", [])]
        unknown = [op for op in ops if op not in FUSING_OPERATIONS]
        if unknown:
            model_type = base_model_type(getattr(model.config, "model_type", "?"))
            raise UnsupportedModelError(
                f"model type {model_type!r}: its checkpoint's {key} is converted by Transformers on loading "
                f"({', '.join(unknown)}), which the streamed conversion does not reproduce"
            )
        fused = out.fused.setdefault(name, Fused(converter))
        fused.sources.setdefault(pattern, []).append(key)
    return out


def _transforms(model):
    """Transformers' renamings and converters for ``model`` (none where this Transformers has no such rules)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return [], []
    transforms = get_model_conversion_mapping(model)
    return (
        [t for t in transforms if isinstance(t, WeightRenaming)],
        [t for t in transforms if isinstance(t, WeightConverter)],
    )


def _rename(key: str, renamings, converters, model, meta) -> tuple[str, str | None]:
    """The model name a checkpoint key loads under, and the converter pattern it matched (``None``: not fused)."""
    from transformers.core_model_loading import rename_source_key

    # positional: the prefix argument is named ``prefix`` in 5.4 and ``base_model_prefix`` later
    return rename_source_key(key, renamings, converters, model.base_model_prefix, meta)


def loaded_name(key: str, model) -> str:
    """The model name Transformers loads the checkpoint key ``key`` under (renamings and base-model prefix)."""
    renamings, converters = _transforms(model)
    return _rename(key, renamings, converters, model, model.state_dict())[0]


@torch.no_grad()
def fuse(name: str, fused: Fused, read, shape) -> torch.Tensor:
    """The model parameter ``name`` made from its checkpoint tensors (``read(key)`` reads one) by the converter's
    operations; ``ValueError`` when the result does not have the model's ``shape``."""
    converter = fused.converter
    tensors: dict = {p: [read(k) for k in fused.sources[p]] for p in converter.source_patterns if p in fused.sources}
    for op in converter.operations:
        tensors = op.convert(tensors, converter.source_patterns, converter.target_patterns, full_layer_name=name)
    if len(tensors) != 1:
        raise ValueError(f"{name}: the checkpoint's tensors fuse into {len(tensors)} parameters, one expected")
    (value,) = tensors.values()
    if isinstance(value, list):
        value = value[0] if len(value) == 1 else torch.stack(value)
    if list(value.shape) != list(shape):
        raise ValueError(
            f"{name}: the checkpoint's tensors fuse into shape {tuple(value.shape)}, the model's is {tuple(shape)}"
        )
    return value

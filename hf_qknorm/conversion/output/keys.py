"""Which checkpoint tensors make each parameter of the model: the names a checkpoint stores and the names the model
loads them under are not always the same.

Transformers renames some checkpoint keys on loading (GPT-NeoX's ``embed_out`` is the model's ``lm_head``; a
checkpoint saved without the base-model prefix), fuses others (a mixture of experts stores ``experts.0.w1``,
``experts.1.w1``, ... which the model holds as one ``experts.gate_up_proj``) and splits some (Sarvam's
``query_key_value`` into ``q_proj``, ``k_proj``, ``v_proj``), and reverses all of it on saving. Its own
rules for a model (``transformers.conversion_mapping.get_model_conversion_mapping``, applied by
``transformers.core_model_loading.rename_source_key`` and the converters' own operations: what its loader calls;
tests/conversion/test_convert_every_type.py fails when they change, through the streamed perplexities of mixture of
experts models) are read here once per conversion, so that the streamed conversion reads every parameter the way
``from_pretrained`` would -- one block at a time -- and writes the checkpoint back in the source's own layout, as
``save_pretrained`` would; the ``qkv_norm`` fold is planned on the checkpoint's own tensors (a split q/k/v
projection is folded whole; a healed projection split off such a tensor is written back into it). A conversion by an
operation other than those of :data:`FUSING_OPERATIONS` -- each stacks, concatenates, splits, chunks, interleaves
or transposes tensors, read by calling it as Transformers' loader does -- is refused in one line, naming it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

# Transformers' operations a parameter may be made with: each stacks, concatenates, splits, chunks, interleaves or
# transposes the checkpoint's tensors (reproduced by calling them with what its loader passes: a transpose that checks
# the model's shape does so on the skeleton; ERNIE 4.5-VL's experts, split between text and vision, read the config).
FUSING_OPERATIONS = (
    "MergeModulelist",
    "Concatenate",
    "Split",
    "Chunk",
    "Interleave",
    "Transpose",
    "ErnieFuseAndSplitTextVisionExperts",
)
# operations that split one checkpoint tensor along its rows into the parameters in the converter's target order
ROW_SPLITS = ("Split", "Chunk")


def _natural(key: str):
    """Sort key that orders ``experts.10`` after ``experts.9`` (the order Transformers stacks experts in)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


@dataclass
class Fused:
    """A model parameter made from checkpoint tensors other than one of its own: ``sources`` (pattern -> keys, in
    order) through the converter's operations, which give ``target`` (the converter's target pattern this parameter
    is; a split makes several) -- stacked experts, or Sarvam's ``query_key_value`` split into q, k and v."""

    converter: object
    sources: dict[str, list[str]] = field(default_factory=dict)
    target: str = ""
    first: str = ""  # the name Transformers gives the converter's first target for this layer (its ``full_layer_name``)


@dataclass
class KeyMap:
    """Model parameter name -> checkpoint key (``direct``) or :class:`Fused` tensors (``fused``). ``rows``: a
    parameter split off the rows of one checkpoint tensor (a fused q/k/v projection Transformers splits on loading)
    -> that tensor's key: a fold of the input channels or a shift of the bias is that tensor's too."""

    direct: dict[str, str] = field(default_factory=dict)
    fused: dict[str, Fused] = field(default_factory=dict)
    checkpoint: dict[str, str] = field(default_factory=dict)  # checkpoint key -> model name (direct ones)
    rows: dict[str, str] = field(default_factory=dict)
    # model name -> checkpoint key of a parameter the conversion never reads (outside a multimodal model's language
    # model) that Transformers makes by an operation it does not reproduce: written as stored, loaded by Transformers
    opaque: dict[str, str] = field(default_factory=dict)

    def __contains__(self, name: str) -> bool:
        return name in self.direct or name in self.fused


def key_map(model, checkpoint_keys, reads=None) -> KeyMap:
    """How each parameter of ``model`` (a skeleton of the source's model, any device) is read from a checkpoint
    holding ``checkpoint_keys``, by Transformers' own renaming and fusing rules for the model. Raises
    ``UnsupportedModelError`` for a fused parameter made by an operation other than :data:`FUSING_OPERATIONS` --
    except where ``reads`` (model name -> whether the conversion reads it; default: every one) says that none of its
    parameters is read (a multimodal model's vision tower): those are :attr:`KeyMap.opaque`, written as stored."""
    from ...portable.families import UnsupportedModelError, base_model_type

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
        operations = getattr(converter, "operations", [])
        ops = [type(op).__name__ for op in operations]
        # a chunk into as many pieces as a config field says names its targets by that field: not reproduced
        unknown = [n for n, op in zip(ops, operations) if n not in FUSING_OPERATIONS or _counted(op)]
        targets = list(converter.target_patterns)
        names = [name.replace(targets[0], t) if t != targets[0] else name for t in targets]
        if unknown and reads is not None and not any(reads(n) for n in names):
            out.opaque.update({n: key for n in names if n in meta})
            continue
        if unknown:
            model_type = base_model_type(getattr(model.config, "model_type", "?"))
            raise UnsupportedModelError(
                f"model type {model_type!r}: its checkpoint's {key} is converted by Transformers on loading "
                f"({', '.join(unknown)}), which the streamed conversion does not reproduce"
            )
        for target, tname in zip(targets, names):  # one parameter per target: a split makes several
            if tname not in meta:
                continue
            fused = out.fused.setdefault(tname, Fused(converter, target=target, first=name))
            fused.sources.setdefault(pattern, []).append(key)
            if len(targets) > 1 and ops and all(o in ROW_SPLITS and op.dim == 0 for o, op in zip(ops, operations)):
                out.rows[tname] = key
    return out


def _counted(op) -> bool:
    return getattr(op, "num_shards_attribute", None) is not None


def row_pieces(key_map: KeyMap, key: str) -> list[str]:
    """The model parameters split off the rows of the checkpoint tensor ``key``, in the order the tensor holds them
    (the converter's targets: Molmo 2's ``ff_proj`` holds up before gate)."""
    names = [n for n, k in key_map.rows.items() if k == key]
    order = {t: i for i, t in enumerate(key_map.fused[names[0]].converter.target_patterns)} if names else {}
    return sorted(names, key=lambda n: order[key_map.fused[n].target])


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
    return loaded_names(model)(key)


def loaded_names(model):
    """:func:`loaded_name` for many keys of one ``model``: its rules and state dict read once."""
    renamings, converters = _transforms(model)
    meta = model.state_dict()
    return lambda key: _rename(key, renamings, converters, model, meta)[0]


@torch.no_grad()
def fuse(name: str, fused: Fused, read, shape, model) -> torch.Tensor:
    """The model parameter ``name`` made from its checkpoint tensors (``read(key)`` reads one) by the converter's
    operations (``model``: a skeleton of the model, whose shapes a split reads); ``ValueError`` when the result does
    not have the model's ``shape``."""
    converter = fused.converter
    tensors: dict = {p: [read(k) for k in fused.sources[p]] for p in converter.source_patterns if p in fused.sources}
    targets = converter.target_patterns
    for op in converter.operations:
        tensors = op.convert(
            tensors,
            converter.source_patterns,
            targets,
            full_layer_name=fused.first,
            model=model,
            config=model.config,
            missing_keys=None,
        )
    if len(tensors) > 1 and fused.target in tensors:
        tensors = {fused.target: tensors[fused.target]}
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

"""The source's own norms read as ``gain * n(x) + bias`` (:func:`hf_qknorm.portable.fold.affine_form`, the rule
:func:`hf_qknorm.patch_model` applies), from the checkpoint, one small module at a time:

- :func:`prenorm_forms`: each block's pre-attention norm, which ``qkv_norm`` removes and folds into the projections
  (a Gemma ``1 + w`` gain folds as ``1 + w``, a LayerNorm's bias as a shift of the projections' biases);
- :func:`native_values`: a model's own per-head q/k norms (Qwen3, Gemma 3, OLMoE's, Persimmon's), whose gain (and
  bias) the scheme's norm that takes their place starts from, so a ``qk_norm`` / ``rmsnorm`` conversion of such a
  model starts as exactly the original model.

Each norm module of a ``meta`` skeleton of the source is copied, given its tensors from the checkpoint (as the
model loads them) and probed in float32 on the CPU; nothing else of the model is materialised.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ...portable.families import Family, UnsupportedModelError
from ...portable.fold import affine_form
from ...portable.layout import find_layers
from .shards import SourceWeights


def materialised(module: nn.Module, prefix: str, weights: SourceWeights) -> nn.Module:
    """A float32 CPU copy of the skeleton's ``module`` (state-dict prefix ``prefix``) with the checkpoint's tensors."""
    copied = copy.deepcopy(module)
    for name, _ in list(copied.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        target = copied.get_submodule(owner) if owner else copied
        value = weights.read_param(f"{prefix}.{name}").to(torch.float32)
        target._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    for owner in copied.modules():
        for key, buf in list(owner._buffers.items()):
            if buf is not None and buf.is_meta:
                owner._buffers[key] = torch.zeros(buf.shape, dtype=buf.dtype)
    return copied.to("cpu")


def prenorm_forms(model: nn.Module, family: Family, weights: SourceWeights) -> list[tuple]:
    """``(gain, bias)`` of every block's pre-attention norm of the source (``model``: a skeleton of it), each
    ``None`` where absent; :class:`UnsupportedModelError` for a norm of no such form (it cannot be folded)."""
    out = []
    for index, block in enumerate(find_layers(model, family)):
        prefix = f"{family.layers}.{index}.{family.prenorm}"
        module = materialised(getattr(block, family.prenorm), prefix, weights)
        try:
            out.append(affine_form(module))
        except ValueError:
            raise UnsupportedModelError(
                f"model type {family.model_type!r}: the pre-attention norm {type(module).__name__} (.{family.prenorm} "
                f"of block {index}) is not of the form gain * n(x) + bias, so qkv_norm cannot fold it"
            ) from None
    return out


def native_values(model: nn.Module, patched: nn.Module, family: Family, weights: SourceWeights, index: int) -> dict:
    """The values the scheme's norms of layer ``index`` start from where they take the place of the model's own
    per-head norms (``model``/``patched``: skeletons of the source and of the patched model): the native norm's
    gain, and its bias where the new norm has one, when their shapes match; by state-dict name. Empty for a model
    without per-head norms of its own."""
    out = {}
    base = f"{family.layers}.{index}.{family.attention}"
    attn = getattr(find_layers(model, family)[index], family.attention)
    new_attn = getattr(find_layers(patched, family)[index], family.attention)
    for name in family.native.values():
        new = new_attn._modules.get(name)
        weight = getattr(new, "weight", None)
        if new is None or weight is None or name not in new_attn.__dict__.get("_qknorm_norms", {}).values():
            continue
        try:
            gain, bias = affine_form(materialised(attn._modules[name], f"{base}.{name}", weights))
        except ValueError:  # not a gain times a normalisation: the new norm starts as identity
            continue
        if gain is not None and list(gain.shape) == list(weight.shape):
            out[f"{base}.{name}.weight"] = gain.detach().float().clone()
        if bias is not None and isinstance(getattr(new, "bias", None), torch.Tensor):
            if list(bias.shape) == list(new.bias.shape):
                out[f"{base}.{name}.bias"] = bias.detach().float().clone()
    return out

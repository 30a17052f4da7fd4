"""LoRA on the attention projections of a patched model, with the new norm weights trainable.

The patched attention computes ``q = q_norm(q_proj(x))``: when ``peft`` wraps ``q_proj``, its LoRA delta is part of
``q_proj(x)`` and so passes through the norm (a LoRA-adapted query is still normalised). The norms themselves are
new, so they must train: they go in ``modules_to_save`` (``peft`` keeps a trainable copy and saves it with the
adapter). ``merge_and_unload()`` folds the deltas into the projections and puts the trained norms back, leaving a
plain patched model that ``save_pretrained`` writes as ``qknorm_<base>``.

    model = hf_qknorm.patch_model(AutoModelForCausalLM.from_pretrained(path), "qk_norm")
    model = hf_qknorm.prepare_lora(model, r=8)        # peft.get_peft_model(model, lora_config(model, r=8))
    ...train...
    merged = model.merge_and_unload()                 # a patched model again
"""

from __future__ import annotations

import re

from torch import nn

from ..portable.names import ROLES
from .sites import attention_sites


def lora_target_modules(model: nn.Module) -> str:
    """A ``peft`` ``target_modules`` regex matching exactly the attention projections of ``model``'s family
    (``q_proj|k_proj|v_proj|o_proj``; GPT-2: ``c_attn|c_proj`` of ``attn``, not the MLP's ``c_proj``)."""
    fam = attention_sites(model)[0].family
    names = [fam.qkv_proj] if fam.fused_qkv else [fam.q_proj, fam.k_proj, fam.v_proj]
    names.append(fam.out_proj)
    return rf".*\.{re.escape(fam.attention)}\.({'|'.join(map(re.escape, names))})"


def trainable_norm_modules(model: nn.Module) -> list[str]:
    """The names (``q_norm``, ``k_norm``, ``v_norm``) of the patched norm modules that have parameters.

    Empty for an unpatched model. ``l2``/``lp``: the key norm has no parameter and is left out."""
    sites = [s for s in attention_sites(model) if s.patched]
    if not sites:
        return []
    attn = sites[0].module
    slots = attn.__dict__.get("_qknorm_norms", {})
    return [
        slots[role] for role in ROLES if role in slots and any(True for _ in getattr(attn, slots[role]).parameters())
    ]


def lora_config(
    model: nn.Module, *, r: int = 8, lora_alpha: int = 16, lora_dropout: float = 0.0, train_norms: bool = True, **kwargs
):
    """A ``peft.LoraConfig`` for LoRA on ``model``'s attention projections, with the norm weights trainable.

    Args:
        model: a (patched) supported model, before ``get_peft_model``.
        r, lora_alpha, lora_dropout: the usual LoRA settings.
        train_norms: put the patched ``q_norm``/``k_norm``/(``v_norm``) in ``modules_to_save``.
        kwargs: any other ``LoraConfig`` field (``modules_to_save`` given here is extended, not replaced).
    GPT-2's ``Conv1D`` projections get ``fan_in_fan_out=True``.
    """
    from peft import LoraConfig, TaskType

    fam = attention_sites(model)[0].family
    extra = list(kwargs.pop("modules_to_save", None) or [])
    to_save = extra + ([n for n in trainable_norm_modules(model) if n not in extra] if train_norms else [])
    kwargs.setdefault("task_type", TaskType.CAUSAL_LM)
    if fam.conv1d:
        kwargs.setdefault("fan_in_fan_out", True)
    return LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=kwargs.pop("target_modules", lora_target_modules(model)),
        modules_to_save=to_save or None,
        **kwargs,
    )


def prepare_lora(model: nn.Module, **kwargs):
    """``peft.get_peft_model(model, lora_config(model, **kwargs))``: LoRA adapters on the attention projections,
    norms trainable, everything else frozen."""
    from peft import get_peft_model

    return get_peft_model(model, lora_config(model, **kwargs))

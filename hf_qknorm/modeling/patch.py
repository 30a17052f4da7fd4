"""``patch_model``: add QK-norm / softmax capping / QKV-norm to a loaded Transformers model, in place.

Patching never replaces Transformers' attention forward (see :mod:`.structure` and :mod:`.hooks`). It checks
everything first, gives the model its own copy of its config (the caller's config object is never changed), applies
the scheme and marks the config as ``qknorm_<base>`` so that ``save_pretrained`` writes a folder that loads back
patched. A patched and an unpatched model can live in the same process.
"""

from __future__ import annotations

import logging

from torch import nn

from ..portable.families import UnsupportedModelError
from ..portable.layout import unwrap
from ..portable.names import ATTN_IMPLEMENTATION
from ..portable.schemes import QKNormConfig
from ..portable.structure import (
    fold_prenorms,
    install_scheme,
    own_config,
    plan_scheme,
    text_model,
    uninstall_scheme,
)
from ..portable.vision import CONFIG_KEY as VISION_KEY
from ..portable.vision import install_vision, plan_vision, uninstall_vision, vision_settings
from .classes import mark_patched
from .selfcheck import self_check
from .sharding import refuse_distributed
from .vision import check_vision, switch_vision_backend

logger = logging.getLogger(__name__)


def _not_a_model(model) -> str:
    if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        return (
            f"patch_model takes a loaded model, not the name or path {str(model)!r}: load it first, e.g. "
            f"model = AutoModelForCausalLM.from_pretrained({str(model)!r}), then patch_model(model, ...)"
        )
    return f"patch_model takes a loaded Transformers model (a torch.nn.Module), not a {type(model).__name__}"


def patch_model(
    model: nn.Module,
    scheme: str | QKNormConfig = "qk_norm_cap",
    *,
    norm: str | None = None,
    softcap: float | None = None,
    eps: float | None = None,
    p: float | None = None,
    vision: bool | QKNormConfig = False,
) -> nn.Module:
    """Patch every attention layer of ``model`` with ``scheme``; returns the same (patched) model.

    Args:
        model: a loaded decoder-only Transformers model of any model type ``hf-qknorm coverage`` lists as patched
            (any head class: ``*ForCausalLM``, the base model, sequence/token classification, question
            answering), in any dtype, optionally wrapped by
            ``peft`` or ``torch.compile``; not yet wrapped by DDP or sharded (FSDP2, tensor parallelism): patch
            first, then wrap or shard, so that the new norms are synchronised like every other parameter. A
            multimodal model (LLaVA, Qwen2-VL, PaliGemma, ...) has its language model patched -- found from its
            structure, checked by the same probe -- and its vision tower left as it was.
        scheme: ``"qk_norm"``, ``"soft_cap"``, ``"qk_norm_cap"`` or ``"qkv_norm"`` -- or a :class:`QKNormConfig`
            (then give no other settings), as ``peft.get_peft_model(model, config)`` takes one.
        norm: ``"layernorm"`` (default), ``"rmsnorm"``, ``"l2"`` or ``"lp"`` (with ``p``); not for ``soft_cap``.
        softcap: the cap ``c``; ``None`` means 50.0 for the capped schemes.
        eps: the norm epsilon; ``None`` takes the model's own norm epsilon.
        p: the exponent of the ``lp`` norm.
        vision: a multimodal model's vision encoder: ``False`` (default) leaves it untouched; ``True`` gives its
            attention the scheme's q/k norm kind, bidirectional and without a cap (ViT-22B's QK-norm); a
            :class:`QKNormConfig` gives it those settings (``qk_norm`` or ``qk_norm_cap`` with ``layernorm`` or
            ``rmsnorm``: a cap only there). Encoders whose attention is not reached exactly are refused
            (:mod:`hf_qknorm.portable.vision`).

    New norm weights start as identity (weight 1, bias 0); ``l2``/``lp`` start their logit scale at Henry et al.'s
    ``log2(L^2 - L)`` for the model's context length ``L``. ``qkv_norm`` removes the pre-attention norm and folds
    its gain (and bias) into the projections that read it. Before the patch is kept, a probe forward on a few
    tokens checks that the scheme reaches the attention backend exactly (:mod:`.selfcheck`); a model on which it
    would not is refused with :class:`~hf_qknorm.UnsupportedModelError` and left as it was. A capped scheme moves
    a model on ``eager``/``sdpa`` (which cannot cap) to the ``"qknorm"`` attention implementation; any other backend
    is refused.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(_not_a_model(model))
    cfg = _resolve_config(scheme, norm=norm, softcap=softcap, eps=eps, p=p)
    refuse_distributed(model)  # patch first, then wrap or shard: DDP/FSDP would not sync the norms added here
    target = unwrap(model)
    try:
        plan = plan_scheme(target, cfg)  # every check that needs no forward happens here, before anything changes
        vision_cfg = vision_settings(cfg, vision)  # eps unresolved: the encoder's own, unless given
        vplan = None if vision_cfg is None else plan_vision(target, vision_cfg)
    except BaseException:
        target.__dict__.pop("_qknorm_family", None)  # a refused model keeps nothing of the attempt
        raise
    old_config = own_config(target)
    replaced = install_scheme(target, plan)
    language = text_model(target)  # a multimodal model's language model: checked and switched on its own
    checking_language = True
    try:
        self_check(language, plan)  # a probe forward: the scheme reaches the backend exactly, or the patch is undone
        checking_language = False
        if vplan is not None:
            install_vision(vplan)
            check_vision(target, vplan)  # the same for the vision encoder's attention (its refusals name it)
    except BaseException as exc:
        if vplan is not None:
            uninstall_vision(vplan)
        uninstall_scheme(plan, replaced)
        own_config(target, old_config)
        target.__dict__.pop("_qknorm_family", None)
        if checking_language and language is not target and isinstance(exc, UnsupportedModelError):
            raise UnsupportedModelError(
                f"model type {target.config.model_type!r} (multimodal), its language model .{plan.family.text_model}: "
                f"{exc}"
            ) from None
        raise
    fold_prenorms(plan)
    mark_patched(target.config, plan.cfg)
    if vplan is not None:
        setattr(target.config, VISION_KEY, vplan.cfg.to_dict())
        switch_vision_backend(target, vplan)
    if plan.switch_backend:
        logger.info(
            "attention implementation %r cannot cap logits; switching to %r",
            language.config._attn_implementation,
            ATTN_IMPLEMENTATION,
        )
        language.set_attn_implementation(ATTN_IMPLEMENTATION)  # the vision encoder keeps its own backend
    return model


def is_patched(model: nn.Module) -> bool:
    """Whether ``model`` (or the model inside a ``peft``/DDP/``torch.compile`` wrapper) is patched."""
    return getattr(unwrap(model).config, "qknorm", None) is not None


def qknorm_config(model: nn.Module) -> QKNormConfig | None:
    """The :class:`QKNormConfig` a model was patched with, or ``None``."""
    d = getattr(unwrap(model).config, "qknorm", None)
    return None if d is None else QKNormConfig.from_dict(d)


def _resolve_config(scheme, **settings) -> QKNormConfig:
    if isinstance(scheme, QKNormConfig):
        given = {k: v for k, v in settings.items() if v is not None}
        if given:
            raise ValueError(
                f"patch_model got a QKNormConfig and also {sorted(given)}; put every setting in the "
                "config (dataclasses.replace(config, ...))"
            )
        return scheme
    return QKNormConfig(scheme=scheme, **settings)

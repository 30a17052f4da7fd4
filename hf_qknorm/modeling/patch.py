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
    """Patch every attention layer of ``model`` with ``scheme`` in place; returns the same model.

    The new norms start as identity (``l2``/``lp``: their logit scale at Henry et al.'s ``log2(L^2 - L)`` for the
    context length ``L``) and sit before RoPE; ``qkv_norm`` folds the pre-attention norm into the projections that
    read it. A probe forward (:mod:`.selfcheck`) checks that the scheme reaches the attention backend exactly: a
    model on which it would not is refused with :class:`~hf_qknorm.UnsupportedModelError` and left as it was. A
    capped scheme moves a model on ``eager``/``sdpa`` to the ``"qknorm"`` backend; any other backend is refused.
    Arguments: docs/patching.md (Settings)."""
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

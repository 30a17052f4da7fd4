"""The structural change of a scheme: checked first, then applied -- by :func:`hf_qknorm.patch_model` and by the
``qknorm_<base>`` classes when a saved folder is loaded.

1. :func:`plan_scheme` checks everything a patch is about to do (family, blocks, attention classes, attention
   backend, the pre-norm fold) before the model is touched, so a refused patch leaves the model exactly as it was.
2. :func:`apply_scheme` adds ``q_norm``/``k_norm``/(``v_norm``) to every attention module and applies them through
   hooks on the projections (:mod:`.hooks`); ``l2``/``lp`` set the module's ``scaling`` to 1 (the query norm carries
   the learnable logit scale); a cap is read by the ``"qknorm"`` attention backend from the module; ``qkv_norm``
   removes the pre-attention norm and folds its gain (and bias) into the projections (:mod:`.fold`, the rule the
   converter uses too).

This module imports nothing but ``torch`` and its siblings: it is also copied into exported folders.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import nn

from .families import Family, UnsupportedModelError, family_of_model, head_dim_of, heads_of, own_roles
from .fold import affine_form, bias_shift, fold_gain, shifted_bias
from .hooks import hook_slots, install, is_installed, uninstall
from .layout import find_layers
from .names import ATTN_IMPLEMENTATION, PREFIX, ROLES
from .norms import henry_logit_scale, make_norm
from .schemes import QKNormConfig
from .vision import CONFIG_KEY as VISION_KEY
from .vision import install_vision, plan_vision

logger = logging.getLogger(__name__)

# Backends a patched model with a cap is moved away from (to "qknorm"): they cannot apply a cap.
REPLACEABLE_BACKENDS = (None, "eager", "sdpa")


# --------------------------------------------------------------------------------------------------------------------
# the plan: everything checked before the model is touched
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class Plan:
    cfg: QKNormConfig  # eps resolved
    family: Family
    blocks: nn.ModuleList
    attentions: list[nn.Module]
    logit_scale: float  # l2/lp initial logit scale
    switch_backend: bool  # a capped scheme on eager/sdpa, or a model's own cap on sdpa, moves to "qknorm"
    prenorm_forms: list  # qkv_norm: (gain, bias) of each block's pre-attention norm, as ``gain * n(x) + bias``


def plan_scheme(model: nn.Module, cfg: QKNormConfig, *, loading: bool = False) -> Plan:
    """Check that ``cfg`` can be applied to ``model`` and say how; raises ``ValueError`` naming the problem
    (:class:`UnsupportedModelError` for a model that cannot be patched exactly). ``loading``: the model is being
    built from a saved ``qknorm_<base>`` config (already marked)."""
    config = model.config
    if not loading and (
        getattr(config, "qknorm", None) is not None or str(getattr(config, "model_type", "")).startswith(PREFIX)
    ):
        raise ValueError(
            f"model is already patched with {getattr(config, 'qknorm', None)!r}; "
            "patching twice is not supported: patch the original model once"
        )
    family = family_of_model(model)
    config = text_model(model).config  # a multimodal model's sizes, backend and eps are its language model's
    if cfg.eps is None:
        cfg = dataclasses.replace(cfg, eps=family.norm_eps(config))
    if getattr(config, "add_cross_attention", False) or getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"model type {family.model_type!r}: this model has cross-attention layers; hf_qknorm patches "
            "self-attention only"
        )
    blocks = find_layers(model, family)
    attentions = [getattr(block, family.attention) for block in blocks]
    forms = []
    own = family.norm_slot("v")
    if cfg.removes_prenorm and not loading and any(isinstance(getattr(a, own, None), nn.Module) for a in attentions):
        raise UnsupportedModelError(
            f"model type {family.model_type!r}: its attention normalises v itself ({type(attentions[0]).__name__}"
            f".{own}); qkv_norm would put a second norm in that place"
        )
    lacking = [i for i, attn in enumerate(attentions) if "v" not in own_roles(attn, family)]
    if cfg.norms_v and lacking:
        raise UnsupportedModelError(
            f"model type {family.model_type!r}: attention layer {lacking[0]} has no value projection of its own (it "
            f"reuses another layer's values or takes them from its keys); scheme {cfg.scheme!r} normalises v"
        )
    if cfg.removes_prenorm:
        if family.prenorm is None:
            raise UnsupportedModelError(
                f"model type {family.model_type!r}: qkv_norm removes the pre-attention norm, and this model's "
                "blocks have none (they normalise after attention, or under a name hf_qknorm does not know)"
            )
        forms = [
            _prenorm_form(block, attn, family, i, loading) for i, (block, attn) in enumerate(zip(blocks, attentions))
        ]
    switch = False
    if cfg.caps:
        impl = getattr(config, "_attn_implementation", None)
        if impl not in (ATTN_IMPLEMENTATION, *REPLACEABLE_BACKENDS):
            raise ValueError(
                f"attention implementation {impl!r} would drop the softcap of scheme {cfg.scheme!r}; "
                f"load the model with attn_implementation={ATTN_IMPLEMENTATION!r} (or 'sdpa'/'eager', "
                f"which patch_model switches to {ATTN_IMPLEMENTATION!r})"
            )
        switch = impl != ATTN_IMPLEMENTATION
    elif getattr(config, "attn_logit_softcapping", None) is not None and config._attn_implementation == "sdpa":
        # the model's own cap (Gemma 2): sdpa cannot apply it (Transformers before 5.24 dropped it without a word)
        switch = True
    if family.native_qk_norm and cfg.norms_qk and cfg.learned_logit_scale and not loading:
        _warn_dropped_native_gain(attentions[0], family, cfg)
    scale = henry_logit_scale(family.training_length(config))
    return Plan(cfg, family, blocks, attentions, scale, switch, forms)


def _prenorm_form(block, attn, family: Family, index: int, loading: bool):
    """``(gain, bias)`` of block ``index``'s pre-attention norm (:func:`.fold.affine_form`), checked foldable."""
    prenorm = getattr(block, family.prenorm)
    try:
        gain, bias = affine_form(prenorm, skip_probe=loading)
    except ValueError:
        raise UnsupportedModelError(
            f"model type {family.model_type!r}: the pre-attention norm {type(prenorm).__name__} (.{family.prenorm} "
            f"of block {index}) is not of the form gain * n(x) + bias, so qkv_norm cannot fold it"
        ) from None
    if bias is not None:
        for name in _prenorm_readers(family):
            if _base(getattr(attn, name)).bias is None:
                raise UnsupportedModelError(
                    f"model type {family.model_type!r}: cannot fold the bias of .{family.prenorm} (block {index}) "
                    f"into .{name}: the projection has no bias"
                )
    return gain, bias


def _warn_dropped_native_gain(attn, family: Family, cfg: QKNormConfig) -> None:
    native = getattr(attn, family.native.get("q", ""), None)
    weight = getattr(native, "weight", None)
    if weight is not None and not weight.is_meta and not torch.all(weight == 1):  # a skeleton has no values
        logger.warning(
            "the model's own per-channel q/k norm gains cannot be carried into norm %r (one scalar logit "
            "scale): they are replaced, so the patched model starts from different attention. Use "
            "norm='rmsnorm' or 'layernorm' to keep them.",
            cfg.norm,
        )


# --------------------------------------------------------------------------------------------------------------------
# the structural change (also run by the qknorm_<base> classes when a saved folder is loaded)
# --------------------------------------------------------------------------------------------------------------------
def install_scheme(model: nn.Module, plan: Plan) -> list:
    """Install the norms, hooks, cap and scaling of ``plan`` on every attention module (reversible: see
    :func:`uninstall_scheme`); returns what was replaced, for that. The pre-norm is removed by :func:`fold_prenorms`."""
    cfg, family = plan.cfg, plan.family
    roles = [r for r in ROLES if (cfg.norms_v if r == "v" else cfg.norms_qk)]
    hooked = {r for r in roles if r not in family.native}  # a native norm's forward call needs no hook
    slots = hook_slots(family, hooked)
    config = text_model(model).config
    replaced = []
    for attn in plan.attentions:
        own = own_roles(attn, family)  # a layer reusing another's keys and values has only its q norm to replace
        head_dim = head_dim_of(attn, config)
        heads, kv_heads = heads_of(attn, config)
        ref = _base(getattr(attn, family.qkv_proj or family.q_proj)).weight
        factory = dict(device=ref.device, dtype=ref.dtype if ref.dtype.is_floating_point else torch.float32)
        norms, old = {}, {}
        for role in (r for r in roles if r in own):
            name = family.norm_slot(role)
            existing = attn._modules.get(name) if role in family.native else None
            new = make_norm(cfg.norm, role, head_dim, cfg.eps, cfg.p, plan.logit_scale).to(**factory)
            _carry_gain(existing, new)
            old[name] = attn._modules.get(name)
            setattr(attn, name, new)
            norms[role] = name
        install(
            attn,
            slots,
            norms,
            (head_dim, heads, kv_heads, family.fused_layout),
            cfg.softcap,
            1.0 if cfg.learned_logit_scale else None,
        )
        replaced.append(old)
    return replaced


def uninstall_scheme(plan: Plan, replaced: list) -> None:
    """Undo :func:`install_scheme` (a patch refused by the self-check leaves the model as it was)."""
    for attn, old in zip(plan.attentions, replaced):
        restore_attention(attn, old)


def restore_attention(attn: nn.Module, old: dict) -> None:
    """Unpatch one attention module and put back the slots an install replaced (``old``: slot -> the module that was
    there, ``None`` where there was none)."""
    uninstall(attn)
    for name, module in old.items():
        if module is None:
            delattr(attn, name)
        else:
            setattr(attn, name, module)


def apply_scheme(model: nn.Module, plan: Plan) -> None:
    """Install the scheme of ``plan`` on every attention module of ``model`` and remove the pre-norm for
    ``qkv_norm`` (checked by :func:`plan_scheme`)."""
    install_scheme(model, plan)
    fold_prenorms(plan)


def _carry_gain(native: nn.Module | None, new: nn.Module) -> None:
    """A native per-head norm's gain and bias (as ``gain * n(x) + bias``, so Gemma's ``1 + w`` too) carried into the
    new norm where it has a per-channel weight (and bias) of the same width: the same arithmetic, the norm is kept.
    A bias the new norm has no parameter for is dropped with a warning."""
    if native is None or getattr(new, "weight", None) is None:
        return
    try:
        gain, bias = affine_form(native, skip_probe=False)
    except ValueError:  # not a gain times a normalisation: the new norm starts as identity
        return
    with torch.no_grad():
        if gain is not None and gain.shape == new.weight.shape:
            new.weight.copy_(gain)
        if bias is None or bias.is_meta or not torch.any(bias != 0):
            return
        if getattr(new, "bias", None) is not None and bias.shape == new.bias.shape:
            new.bias.copy_(bias)
        else:
            logger.warning(
                "the model's own q/k norm bias (%s) has no place in norm %s: it is dropped, so the patched model "
                "starts from different attention. Use norm='layernorm' to keep it.",
                type(native).__name__,
                type(new).__name__,
            )


def _base(proj: nn.Module) -> nn.Module:
    return getattr(proj, "base_layer", proj)  # peft LoRA wrapper


def _prenorm_readers(family: Family) -> list[str]:
    return [family.qkv_proj] if family.fused_qkv else [family.q_proj, family.k_proj, family.v_proj]


def fold_prenorms(plan: Plan) -> None:
    """``qkv_norm``: drop each block's pre-attention norm and fold its gain (and bias) into the projections reading
    it (the rule of :mod:`hf_qknorm.portable.fold`). A ``peft`` LoRA A matrix reads the same input, so it takes the
    gain too."""
    if not plan.cfg.removes_prenorm:
        return
    family = plan.family
    for block, attn, (gain, bias) in zip(plan.blocks, plan.attentions, plan.prenorm_forms):
        with torch.no_grad():
            for name in _prenorm_readers(family):
                proj = getattr(attn, name)
                base = _base(proj)
                lora = [(a, proj.lora_B[k], proj.scaling[k]) for k, a in getattr(proj, "lora_A", {}).items()]
                if bias is not None:  # from the unfolded weights: W (g*n + b) = (W diag g) n + W b, LoRA's too
                    shift = bias_shift(base.weight, bias, family.conv1d)
                    for lora_a, lora_b, scale in lora:
                        shift = shift + scale * bias_shift(lora_b.weight, bias_shift(lora_a.weight, bias, False), False)
                    base.bias.copy_(shifted_bias(base.bias, shift))
                if gain is not None:
                    base.weight.copy_(fold_gain(base.weight, gain, family.conv1d))
                    for lora_a, _, _ in lora:  # LoRA's A reads the same input as the base weight
                        lora_a.weight.copy_(fold_gain(lora_a.weight, gain, conv1d=False))
        setattr(block, family.prenorm, nn.Identity())


# --------------------------------------------------------------------------------------------------------------------
# the config: the model's own copy
# --------------------------------------------------------------------------------------------------------------------
def own_config(model: nn.Module, config=None):
    """Give ``model`` (and every submodule that shares it) a private copy of its config, so patching never changes
    a config object the caller may reuse for another model; returns the config it had. With ``config``: put that
    one back instead (a refused patch). A submodule holding one of the config's sub-configs (a multimodal model's
    language model holds its ``text_config``) is given the copy's."""
    old = model.config
    new = copy.deepcopy(old) if config is None else config
    swap = {id(a): b for a, b in _config_pairs(old, new)}
    for module in model.modules():
        held = module.__dict__.get("config")
        if held is not None and id(held) in swap:
            module.config = swap[id(held)]
    return old


def _config_pairs(a, b, depth: int = 0):
    """``(a, b)`` and the pairs of their sub-configs (attributes that are configs themselves), recursively."""
    yield a, b
    if depth > 4:
        return
    for name, value in vars(a).items():
        other = vars(b).get(name)
        if value is not a and hasattr(value, "to_json_string") and type(other) is type(value):
            yield from _config_pairs(value, other, depth + 1)


def text_model(model: nn.Module) -> nn.Module:
    """The module a scheme acts on and is checked on: a multimodal model's language model
    (:attr:`Family.text_model`), else ``model`` itself."""
    path = family_of_model(model).text_model
    return model.get_submodule(path) if path else model


def patch_on_init(model: nn.Module) -> None:
    """Build the patched structure of a model constructed from a saved ``qknorm_<base>`` config (its weights are
    then loaded into it). The scheme is validated with the same rules as :class:`QKNormConfig`."""
    settings = getattr(model.config, "qknorm", None)
    if settings is None:
        raise ValueError(f"{type(model.config).__name__} has no 'qknorm' entry: this config was not saved by hf_qknorm")
    plan = plan_scheme(model, QKNormConfig.from_dict(settings), loading=True)
    if all(is_installed(attn) for attn in plan.attentions):
        return  # built from already-patched parts (a head class whose base model is made by AutoModel)
    apply_scheme(model, plan)
    if plan.switch_backend:  # a multimodal model's language model only: its vision encoder keeps its backend
        text_model(model).set_attn_implementation(ATTN_IMPLEMENTATION)
    vision = getattr(model.config, VISION_KEY, None)
    if vision is not None:  # the vision encoder's own settings (patch_model(..., vision=...))
        vplan = plan_vision(model, QKNormConfig.from_dict(vision), loading=True)
        install_vision(vplan)
        if vplan.cfg.caps:
            model.get_submodule(vplan.path).set_attn_implementation(ATTN_IMPLEMENTATION)

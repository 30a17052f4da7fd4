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

from .families import Family, UnsupportedModelError, family_of_model, head_dim_of, heads_of
from .fold import affine_form, bias_shift, fold_gain, shifted_bias
from .hooks import hook_slots, install, is_installed, uninstall
from .layout import find_layers
from .names import ATTN_IMPLEMENTATION, CLASS_PREFIX, PREFIX
from .norms import henry_logit_scale, init_unloaded_norms, make_norm
from .schemes import QKNormConfig

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
    switch_backend: bool  # a capped scheme on eager/sdpa moves to "qknorm"
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
    if weight is not None and not torch.all(weight == 1):
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
    roles = [r for r in ("q", "k", "v") if (cfg.norms_v if r == "v" else cfg.norms_qk)]
    hooked = {r for r in roles if r not in family.native}  # a native norm's forward call needs no hook
    slots = hook_slots(family, hooked)
    config = model.config
    replaced = []
    for attn in plan.attentions:
        head_dim = head_dim_of(attn, config)
        heads, kv_heads = heads_of(attn, config)
        ref = _base(getattr(attn, family.qkv_proj or family.q_proj)).weight
        factory = dict(device=ref.device, dtype=ref.dtype if ref.dtype.is_floating_point else torch.float32)
        norms, old = {}, {}
        for role in roles:
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
    """A native per-head norm's gain (as ``gain * n(x)``, so Gemma's ``1 + w`` too) carried into the new norm
    when it has a per-channel weight of the same width (``rmsnorm``: the same arithmetic, the norm is kept)."""
    if native is None or getattr(new, "weight", None) is None:
        return
    try:
        gain, _ = affine_form(native, skip_probe=False)
    except ValueError:  # not a gain times a normalisation: the new norm starts as identity
        return
    if gain is not None and gain.shape == new.weight.shape:
        with torch.no_grad():
            new.weight.copy_(gain)


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
    one back instead (a refused patch)."""
    old = model.config
    new = copy.deepcopy(old) if config is None else config
    for module in model.modules():
        if module.__dict__.get("config") is old:
            module.config = new
    return old


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
    if plan.switch_backend:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)


# --------------------------------------------------------------------------------------------------------------------
# loading: the checkpoint must hold exactly the weights of the scheme
# --------------------------------------------------------------------------------------------------------------------
NORM_SLOTS = ("q_norm", "k_norm", "v_norm")  # where a model without q/k norms of its own gets the scheme's


class SchemeWeightsError(ValueError):
    """A saved ``qknorm_<base>`` folder's weights do not match its scheme: a norm weight is missing, unexpected or
    of another shape. ``save_pretrained`` and ``hf-qknorm convert`` write exactly the scheme's norm weights, so such a
    folder was edited, truncated or mixed up; loading it anyway would run fresh (identity) norms in place of the
    trained ones -- a model that computes its scheme faithfully on the wrong weights."""


def check_scheme_weights(model: nn.Module, loading_info) -> None:
    """Raise :class:`SchemeWeightsError` when ``loading_info`` (Transformers' ``LoadStateDictInfo`` of a
    ``from_pretrained`` into a ``qknorm_<base>`` class) reports a scheme weight missing, unexpected or of another
    shape (with ``ignore_mismatched_sizes=True``, where Transformers would re-initialise it).

    Scheme weights: the parameters of the ``q_norm``/``k_norm``/``v_norm`` modules of every attention module the
    model has (Qwen3's own norms of ``soft_cap`` included), and for ``qkv_norm`` the pre-attention norm it removes
    (its gain lives folded in the projections; a checkpoint still holding it was not saved from this scheme).
    Checkpoint keys of layers the model does not have (a config cut to fewer layers) are left to Transformers'
    report: a partial load of whole layers is an ordinary thing to do."""
    settings = getattr(model.config, "qknorm", None) or {}
    family = family_of_model(model)
    prenorm = family.prenorm if settings.get("scheme") == "qkv_norm" else None
    slots = {family.norm_slot(role) for role in ("q", "k", "v")}
    missing = [k for k in loading_info.missing_keys if _scheme_key(model, k, prenorm, slots)]
    unexpected = [k for k in loading_info.unexpected_keys if _scheme_key(model, k, prenorm, slots)]
    mismatched = [m for m in loading_info.mismatched_keys if _scheme_key(model, m[0], prenorm, slots)]
    if not (missing or unexpected or mismatched):
        return
    parts = []
    if missing:
        parts.append(f"missing {keys_text(missing)}")
    if unexpected:
        parts.append(f"unexpected {keys_text(unexpected)}")
    if mismatched:
        key, saved, wanted = sorted(mismatched)[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        parts.append(f"{key} has shape {tuple(saved)} in the checkpoint, {tuple(wanted)} in the model{more}")
    where = getattr(model.config, "_name_or_path", "") or "the checkpoint"
    scheme = settings.get("scheme")
    norm = f" / {settings['norm']}" if settings.get("norm") else ""
    raise SchemeWeightsError(
        f"{where}: the norm weights do not match scheme {scheme}{norm}: {'; '.join(parts)}. A folder written by "
        "save_pretrained or hf-qknorm convert holds exactly its scheme's norm weights, so this one was edited or "
        "mixed up; loading it would run fresh norms in place of trained ones. To start from fresh norms, load the "
        "unpatched model and call hf_qknorm.patch_model"
    )


def _scheme_key(model: nn.Module, key: str, prenorm: str | None, slots: set[str]) -> bool:
    """Whether state-dict ``key`` is a scheme weight of an attention module (or removed pre-norm) ``model`` has."""
    owner, _, _ = key.rpartition(".")
    parent, _, slot = owner.rpartition(".")
    if slot not in slots and slot != prenorm:
        return False
    try:
        model.get_submodule(parent if slot in slots else owner)
    except AttributeError:  # a layer the model does not have
        return False
    return True


def keys_text(keys) -> str:
    """``model.layers.*.self_attn.q_norm.weight (layers 0, 1)``-style summary of state-dict keys, one line."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for key in sorted(keys):
        parts = key.split(".")
        at = next((i for i, part in enumerate(parts[:-1]) if part.isdigit()), None)  # the layer index
        pattern = key if at is None else ".".join(parts[:at] + ["*"] + parts[at + 1 :])
        groups.setdefault(pattern, []).append((-1 if at is None else int(parts[at]), key))
    items = []
    for pattern, members in sorted(groups.items()):
        if len(members) == 1:
            items.append(members[0][1])
            continue
        numbered = sorted(layer for layer, _ in members)
        shown = ", ".join(map(str, numbered[:6])) + (", ..." if len(numbered) > 6 else "")
        items.append(f"{pattern} (layers {shown})")
    more = f" and {len(items) - 4} more" if len(items) > 4 else ""
    return ", ".join(items[:4]) + more


# --------------------------------------------------------------------------------------------------------------------
# the qknorm_<base> classes: one factory for the plugin and for the exported remote code
# --------------------------------------------------------------------------------------------------------------------
# Auto class -> Transformers' mapping (in ``transformers.models.auto.modeling_auto``) from config class to model
# class. Every head class a family has in these mappings gets a ``QKNorm`` twin that loads a saved folder patched.
AUTO_HEADS = (
    ("AutoModel", "MODEL_MAPPING"),
    ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING"),
    ("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING"),
    ("AutoModelForTokenClassification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING"),
    ("AutoModelForQuestionAnswering", "MODEL_FOR_QUESTION_ANSWERING_MAPPING"),
)
REMOTE_CONFIG_MODULE, REMOTE_MODELING_MODULE = "configuration_qknorm", "modeling_qknorm"


class PatchedConfigMixin:
    """Mixed into every ``QKNorm<Base>Config``. What it saves: ``architectures`` naming the patched classes (so no tool
    that dispatches on them -- vLLM, pipelines -- loads the folder as the unpatched base model), and an ``auto_map``
    pointing at the remote code saved beside it (so the folder loads without the plugin, with
    ``trust_remote_code=True``)."""

    def to_dict(self):
        out = super().to_dict()
        archs = out.get("architectures") or []
        out["architectures"] = [patched_architecture(a) for a in archs] or None
        out["auto_map"] = auto_map(type(self).__name__, out["architectures"])
        return out

    @property
    def output_attentions(self):
        return self._output_attentions

    @output_attentions.setter
    def output_attentions(self, value):
        # Transformers accepts output_attentions only with eager attention (sdpa and flash return no weights). The
        # "qknorm" backend returns them, and a capped model cannot run on eager: accept it there too.
        if value and getattr(self, "_attn_implementation", None) == ATTN_IMPLEMENTATION:
            self._output_attentions = value
            return
        for klass in type(self).__mro__:
            prop = vars(klass).get("output_attentions")
            if klass is not PatchedConfigMixin and isinstance(prop, property) and prop.fset is not None:
                prop.fset(self, value)
                return
        self._output_attentions = value


def patched_architecture(name: str) -> str:
    """``QKNormLlamaForCausalLM`` for ``LlamaForCausalLM`` (and for itself)."""
    return name if name.startswith(CLASS_PREFIX) else CLASS_PREFIX + name


def auto_map(config_class_name: str, architectures) -> dict:
    """``auto_map`` of a saved folder: the config class and the saved architecture in the remote code."""
    out = {"AutoConfig": f"{REMOTE_CONFIG_MODULE}.{config_class_name}"}
    for arch in architectures or []:
        head = next((h for h in _HEAD_SUFFIXES if arch.endswith(h)), None)
        auto = "AutoModelForCausalLM" if head in ("ForCausalLM", "LMHeadModel") else f"AutoModel{head or ''}"
        out[auto] = f"{REMOTE_MODELING_MODULE}.{arch}"
        if head is not None:  # the base model loads from any head's folder
            out.setdefault("AutoModel", f"{REMOTE_MODELING_MODULE}.{arch[: -len(head)]}Model")
    return out


_HEAD_SUFFIXES = (
    "ForCausalLM",
    "LMHeadModel",
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
)


def make_config_class(base_config: type, model_type: str, module: str) -> type:
    """``QKNorm<Base>Config``: ``base_config`` with ``model_type`` ``qknorm_<model_type>``, defined in ``module``.
    Its callers (which may import Transformers) also call :func:`share_conversion_mapping`."""
    return type(
        CLASS_PREFIX + base_config.__name__,
        (PatchedConfigMixin, base_config),
        {"model_type": PREFIX + model_type, "__module__": module},
    )


def share_conversion_mapping(model_type: str, conversion_mapping) -> None:
    """Register the base type's checkpoint conversion mapping (how Transformers renames and fuses a mixture of
    experts' weights on loading, and back on saving) for ``qknorm_<model_type>`` too, so a patched model saves its
    weights in the base model's layout and loads them back the same way, with or without the plugin.
    ``conversion_mapping``: the module ``transformers.conversion_mapping``, or ``None`` where it does not exist."""
    get = getattr(conversion_mapping, "get_checkpoint_conversion_mapping", None)
    register = getattr(conversion_mapping, "register_checkpoint_conversion_mapping", None)
    if get is None or register is None:
        return
    mapping = get(model_type)
    if mapping and not get(PREFIX + model_type):
        register(PREFIX + model_type, mapping)


def make_model_class(base_model: type, config_class: type, module: str) -> type:
    """``QKNorm<Base>``: builds ``base_model``, then its patched structure from ``config.qknorm``, so a saved
    folder's norm weights have somewhere to load into."""

    def __init__(self, config, *args, **kwargs):
        base_model.__init__(self, config, *args, **kwargs)
        patch_on_init(self)

    def _get_name(self):
        # Transformers' Trainer tells a causal LM by this name (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) to shift the
        # labels of its label smoothing; under its own name a loaded patched model would be smoothed unshifted.
        return base_model.__name__

    def _initialize_missing_keys(self, *args, **kwargs):
        # Weights a checkpoint lacks are initialised by the family's _init_weights, which does not know the norms.
        base_model._initialize_missing_keys(self, *args, **kwargs)
        init_unloaded_norms(self)

    def _adjust_missing_and_unexpected_keys(self, loading_info, *args, **kwargs):
        # Transformers' last word on what a checkpoint lacked or held in excess (its report follows): a scheme
        # weight among them is an error, never fresh norms run in place of trained ones.
        base_model._adjust_missing_and_unexpected_keys(self, loading_info, *args, **kwargs)
        check_scheme_weights(self, loading_info)

    def is_custom_code(cls) -> bool:
        # Transformers takes a class defined outside its package for custom code and then skips _init_weights on
        # modules without parameters of their own (GPT-2's scaled init of c_proj lives there). This class runs its
        # family's own code.
        return base_model.is_custom_code()

    body = {"__init__": __init__, "_get_name": _get_name, "config_class": config_class, "__module__": module}
    if hasattr(base_model, "_initialize_missing_keys"):
        body["_initialize_missing_keys"] = _initialize_missing_keys
    if hasattr(base_model, "_adjust_missing_and_unexpected_keys"):
        body["_adjust_missing_and_unexpected_keys"] = _adjust_missing_and_unexpected_keys
    if hasattr(base_model, "is_custom_code"):
        body["is_custom_code"] = classmethod(is_custom_code)
    return type(patched_architecture(base_model.__name__), (base_model,), body)

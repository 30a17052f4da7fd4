"""The ``qknorm_<base>`` config and model classes: one factory for the plugin (:mod:`hf_qknorm.modeling.classes`)
and for the exported remote code (``portable/entry``), and what a saved ``config.json`` says about them.

This module imports nothing but ``torch`` and its siblings: it is also copied into exported folders.
"""

from __future__ import annotations

from .names import ATTN_IMPLEMENTATION, CLASS_PREFIX, PREFIX
from .norms import init_unloaded_norms
from .structure import patch_on_init
from .weights import check_scheme_weights

# Auto class -> Transformers' mapping (in ``transformers.models.auto.modeling_auto``) from config class to model
# class. Every head class a family has in these mappings gets a ``QKNorm`` twin that loads a saved folder patched.
AUTO_HEADS = (
    ("AutoModel", "MODEL_MAPPING"),
    ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING"),
    ("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING"),
    ("AutoModelForTokenClassification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING"),
    ("AutoModelForQuestionAnswering", "MODEL_FOR_QUESTION_ANSWERING_MAPPING"),
)
# The Auto classes of multimodal models (LLaVA, Qwen2-VL, ...), whose language model the scheme patches. Releases
# that lack one are skipped (:func:`heads_of_release`).
MULTIMODAL_HEADS = (
    ("AutoModelForImageTextToText", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING"),
    ("AutoModelForMultimodalLM", "MODEL_FOR_MULTIMODAL_LM_MAPPING"),
)
# A multimodal model's head class (``LlavaForConditionalGeneration``) and the Auto classes that load it.
MULTIMODAL_SUFFIX = "ForConditionalGeneration"
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
        out["auto_map"] = auto_map(type(self).__name__, out["architectures"], multimodal="text_config" in out)
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


def heads_of_release(modeling_auto) -> list[tuple[str, str]]:
    """``(Auto class, mapping)`` of :data:`AUTO_HEADS` and :data:`MULTIMODAL_HEADS` that the installed
    Transformers' ``modeling_auto`` module has."""
    return [(a, m) for a, m in (*AUTO_HEADS, *MULTIMODAL_HEADS) if hasattr(modeling_auto, m + "_NAMES")]


def patched_architecture(name: str) -> str:
    """``QKNormLlamaForCausalLM`` for ``LlamaForCausalLM`` (and for itself)."""
    return name if name.startswith(CLASS_PREFIX) else CLASS_PREFIX + name


def auto_map(config_class_name: str, architectures, multimodal: bool = False) -> dict:
    """``auto_map`` of a saved folder: the config class and the saved architecture in the remote code.
    ``multimodal``: the config holds a text config of its own (a multimodal model), whose causal-LM head (Fuyu's)
    loads through the image-text-to-text Auto classes too."""
    out = {"AutoConfig": f"{REMOTE_CONFIG_MODULE}.{config_class_name}"}
    for arch in architectures or []:
        head = next((h for h in _HEAD_SUFFIXES if arch.endswith(h)), None)
        causal = ["AutoModelForCausalLM"] if head in ("ForCausalLM", "LMHeadModel") else []
        if head == MULTIMODAL_SUFFIX or (multimodal and causal):
            autos = causal + [a for a, _ in MULTIMODAL_HEADS]
        else:
            autos = causal or [f"AutoModel{head or ''}"]
        for auto in autos:
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
    MULTIMODAL_SUFFIX,
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


def _share_class_conversion_mapping(base_model: type) -> None:
    """Register the conversion mapping Transformers keeps under ``base_model``'s class name (GPT-NeoX's
    ``embed_out`` -> ``lm_head`` is ``GPTNeoXForCausalLM``'s, not ``gpt_neox``'s) for its ``QKNorm`` twin too, so
    that twin loads the checkpoint its base class saves. Transformers is imported by then (``base_model`` is one of
    its classes); this module still imports nothing of it."""
    import sys

    conversion_mapping = sys.modules.get("transformers.conversion_mapping")
    get = getattr(conversion_mapping, "get_checkpoint_conversion_mapping", None)
    register = getattr(conversion_mapping, "register_checkpoint_conversion_mapping", None)
    if get is None or register is None:
        return
    mapping = get(base_model.__name__)
    name = patched_architecture(base_model.__name__)
    if mapping and not get(name):
        register(name, mapping)


def make_model_class(base_model: type, config_class: type, module: str) -> type:
    """``QKNorm<Base>``: builds ``base_model``, then its patched structure from ``config.qknorm``, so a saved
    folder's norm weights have somewhere to load into."""
    _share_class_conversion_mapping(base_model)

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

"""A saved model folder's ``config.json``, read once with a clear error.

Kept here (not in the CLI) because ``convert``, ``inspect`` and ``verify`` all read it: what Transformers itself says
of a config.json that is valid JSON but no object depends on its version, so the check is ours and says the same
thing everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..portable.families import base_model_type, text_config_of
from ..portable.names import PREFIX

_JSON_TYPES = {list: "array (list)", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def read_config(folder) -> dict:
    """``folder/config.json`` as a dict; a clear one-line error when the folder, the file or its JSON object is
    missing (``FileNotFoundError``) or the JSON is invalid or not an object (``ValueError``)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"folder not found: {folder}")
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json (not a saved model folder)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        kind = _JSON_TYPES.get(type(raw), type(raw).__name__)
        raise ValueError(f"{path} is not a model config: a JSON {kind}, not an object")
    check_saved_model_type(raw.get("model_type", ""), path)
    return raw


def check_saved_model_type(model_type, where) -> None:
    """A ``qknorm_<base>`` model type whose base this Transformers does not know -- a folder written with a newer
    Transformers, or edited -- named in one line (Transformers would otherwise look for remote code and ask on
    stdin)."""
    model_type = str(model_type)
    if not model_type.startswith(PREFIX):
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if base_model_type(model_type) not in CONFIG_MAPPING_NAMES:
        raise ValueError(
            f"{where}: model_type {model_type!r} names a base model type this Transformers does not know "
            f"({base_model_type(model_type)!r}); was it written with a newer Transformers?"
        )


def auto_class(config):
    """The Auto class whose model a checkpoint of ``config`` is: ``AutoModelForCausalLM``, or for a multimodal model
    ``AutoModelForImageTextToText`` where it has such a class (LLaVA, Gemma 3, Qwen2-VL, ...) -- the class that holds
    its language model, its vision tower and its output head as the checkpoint stores them, and the one a saved
    folder's remote code maps. A type whose image-text-to-text class is another type's model while it has an
    image-classification class (ShieldGemma 2: a classifier holding a whole Gemma 3 model) is stored as that
    classifier: ``AutoModelForImageClassification`` (Transformers' own save and load of the other class loses its
    weights). A multimodal model with no image-text-to-text class but a multimodal-LM one (an audio model) is
    ``AutoModelForMultimodalLM``."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    model_type = base_model_type(getattr(config, "model_type", ""))
    multimodal = text_config_of(config) is not config
    if multimodal and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        if _wraps_another_type(model_type):
            return transformers.AutoModelForImageClassification
        return transformers.AutoModelForImageTextToText
    if multimodal and model_type in _multimodal_lm_names():
        return transformers.AutoModelForMultimodalLM  # an audio model (MOSS Transcribe-Diarize): the class its remote
        # code maps, as any multimodal head's
    if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return transformers.AutoModelForImageTextToText  # a text model Transformers maps there alone (Mistral 4)
    return transformers.AutoModelForCausalLM


def unbuildable_reason(config) -> str | None:
    """Why :func:`auto_class` cannot build or load a model of ``config`` (``None`` where it can): Transformers'
    Auto classes find a model by the config's class, through the model type that class maps back to, and a config
    class two model types share can map back to one its Auto class does not hold (Evolla's ``EvollaConfig``, whose
    model types are ``evolla`` and ``EvollaModel``). Its own class still builds it (:func:`own_class`)."""
    cls = auto_class(config)
    try:
        if type(config) in cls._model_mapping:
            return None
    except KeyError:  # Transformers 5.4's lookup raises for a model type it does not hold instead of saying no
        pass
    model_type = getattr(config, "model_type", "?")
    return (
        f"Transformers' {cls.__name__} cannot build or load a {type(config).__name__} (the config class maps back "
        f"to another model type than {model_type!r}), so a checkpoint of it does not load through the Auto classes"
    )


def own_class(config):
    """The model class ``config``'s :func:`auto_class` names for its model type, found by name (where the Auto class
    itself cannot resolve the config: :func:`unbuildable_reason`)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    cls = auto_class(config)
    names = cls._model_mapping._model_mapping  # model type -> class name
    own = base_model_type(getattr(config, "model_type", ""))
    kinds = [own, *(t for t, name in CONFIG_MAPPING_NAMES.items() if name == type(config).__name__)]
    for kind in kinds:
        if kind in names:
            return getattr(transformers, names[kind])
    raise ValueError(f"{cls.__name__} names no model class for {type(config).__name__} (model type {own!r})")


def _multimodal_lm_names() -> dict:
    """Transformers' multimodal-LM model types (empty in a release without ``AutoModelForMultimodalLM``)."""
    from transformers.models.auto import modeling_auto

    return getattr(modeling_auto, "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", {})


def _wraps_another_type(model_type: str) -> bool:
    """Whether ``model_type``'s image-text-to-text class is built for another model type's config while it has an
    image-classification class (ShieldGemma 2's maps to Gemma 3's model, which its classifier holds)."""
    import transformers
    from transformers.models.auto import modeling_auto

    if model_type not in modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES:
        return False
    cls = getattr(transformers, modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type], None)
    return cls is not None and getattr(cls.config_class, "model_type", model_type) != model_type

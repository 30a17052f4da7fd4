"""The family of a model type or config, for code that has no model in hand (conversion, ``inspect``, the
coverage table): derived from a skeleton of the model built on the ``meta`` device, which costs no memory.
"""

from __future__ import annotations

import functools

from ..portable.families import Family, UnsupportedModelError, base_model_type, derive_family


def get_family(what) -> Family:
    """The :class:`~hf_qknorm.portable.families.Family` of a model type (``"mistral"``), a config, or a model.
    Raises :class:`~hf_qknorm.portable.families.UnsupportedModelError` (a ``ValueError``) naming the model type and
    what is missing."""
    from torch import nn

    if isinstance(what, nn.Module):
        from ..portable.layout import family_of

        return family_of(what)
    if isinstance(what, str):
        return _family_of_type(base_model_type(what))
    return _skeleton_family(what)


@functools.cache
def _family_of_type(model_type: str) -> Family:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not known to this Transformers; `hf-qknorm coverage` lists the model "
            "types hf_qknorm patches"
        )
    try:
        config = CONFIG_MAPPING[model_type]()
    except Exception as exc:  # a config class that cannot be built with its defaults
        raise UnsupportedModelError(
            f"model type {model_type!r}: its default config cannot be built ({type(exc).__name__}: {exc}); "
            "pass its config instead"
        ) from None
    return _skeleton_family(config)


def _skeleton_family(config) -> Family:
    import torch
    from transformers import AutoModelForCausalLM

    from ..portable.families import out_of_scope

    config = _base_config(config)
    reason = out_of_scope(config)
    if reason:
        raise UnsupportedModelError(reason)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:
        raise UnsupportedModelError(
            f"model type {config.model_type!r}: no causal-LM model can be built from this config "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
    return derive_family(model)


def _base_config(config):
    """A patched ``qknorm_<base>`` config read as its base type's config (the family is the base model's)."""
    model_type = str(getattr(config, "model_type", ""))
    if model_type == base_model_type(model_type):
        return config
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    data = {k: v for k, v in config.to_dict().items() if k not in ("qknorm", "auto_map", "architectures")}
    data.pop("model_type", None)
    return CONFIG_MAPPING[base_model_type(model_type)].from_dict(data)

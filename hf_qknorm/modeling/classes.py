"""The ``qknorm_<base>`` config and model classes of the plugin, registered with the Auto classes.

A patched model's config becomes ``QKNorm<Base>Config`` (``model_type`` ``qknorm_<base>``) carrying the scheme as
``config.qknorm``; ``save_pretrained`` writes both to ``config.json`` together with the remote code that loads the
folder without the plugin (:mod:`.remote`). After ``import hf_qknorm``, ``AutoModelFor*.from_pretrained(folder)``
builds ``QKNorm<Head>`` -- the base head class, patched in ``__init__`` from ``config.qknorm`` -- for every head class
the family has (causal LM, base model, sequence and token classification, question answering). Without the plugin
Transformers asks for ``trust_remote_code=True`` and then loads the shipped code; it never loads the folder as the
unpatched base model.
"""

from __future__ import annotations

from ..portable.families import FAMILIES, family_of_config
from ..portable.schemes import QKNormConfig
from ..portable.structure import AUTO_HEADS, make_config_class, make_model_class

_CONFIGS: dict[str, type] = {}
_MODELS: dict[type, type] = {}  # base model class -> patched subclass


def _saving_remote_code(cls: type):
    """``cls.save_pretrained``: ``config.json`` (through ``to_dict``: patched architectures and ``auto_map``) plus
    the remote code files beside it. ``model.save_pretrained(..., push_to_hub=True)`` and ``model.push_to_hub``
    upload the whole folder, remote code included."""

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        from .remote import add_remote_code

        if push_to_hub:
            raise ValueError(
                "push a patched model's folder with model.push_to_hub(repo_id), "
                "model.save_pretrained(dir, push_to_hub=True) or `hf-qknorm push DIR REPO_ID`, which "
                "upload the remote code with the config"
            )
        super(cls, self).save_pretrained(save_directory, **kwargs)
        add_remote_code(save_directory)

    return save_pretrained


def config_class(model_type: str) -> type:
    """``QKNorm<Base>Config`` for base ``model_type`` (created once, registered with ``AutoConfig``)."""
    if model_type not in _CONFIGS:
        from transformers import AutoConfig
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        cls = make_config_class(CONFIG_MAPPING[model_type], model_type, __name__)
        cls.save_pretrained = _saving_remote_code(cls)
        globals()[cls.__name__] = cls  # importable by name, so pickling and copying work
        AutoConfig.register(cls.model_type, cls, exist_ok=True)
        _CONFIGS[model_type] = cls
    return _CONFIGS[model_type]


def model_class(base_cls: type, model_type: str) -> type:
    """``QKNorm<Base>`` twin of a model class (created once)."""
    if base_cls not in _MODELS:
        cls = make_model_class(base_cls, config_class(model_type), __name__)
        globals()[cls.__name__] = cls
        _MODELS[base_cls] = cls
    return _MODELS[base_cls]


def mark_patched(config, cfg: QKNormConfig) -> None:
    """Record the scheme on a model's (own) config and make it a ``QKNorm<Base>Config``."""
    config.__class__ = config_class(family_of_config(config).model_type)
    config.qknorm = cfg.to_dict()


def register_auto_classes() -> None:
    """Register ``qknorm_<base>`` with ``AutoConfig`` and every Auto model class of :data:`AUTO_HEADS`."""
    import transformers
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for model_type in FAMILIES:
        cfg_cls, base_cfg = config_class(model_type), CONFIG_MAPPING[model_type]
        for auto_name, mapping_name in AUTO_HEADS:
            mapping = getattr(modeling_auto, mapping_name)
            if base_cfg in mapping:
                getattr(transformers, auto_name).register(
                    cfg_cls, model_class(mapping[base_cfg], model_type), exist_ok=True
                )

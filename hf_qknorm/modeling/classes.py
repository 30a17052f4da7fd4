"""The ``qknorm_<base>`` config and model classes of the plugin, registered with the Auto classes on first use.

A patched model's config becomes ``QKNorm<Base>Config`` (``model_type`` ``qknorm_<base>``) carrying the scheme as
``config.qknorm``; ``save_pretrained`` writes both to ``config.json`` together with the remote code that loads the
folder without the plugin (:mod:`.remote`). After ``import hf_qknorm``, ``AutoModelFor*.from_pretrained(folder)``
builds ``QKNorm<Head>`` -- the base head class, patched in ``__init__`` from ``config.qknorm`` -- for every head class
the base model type has (causal LM, base model, sequence and token classification, question answering). Without the
plugin Transformers asks for ``trust_remote_code=True`` and then loads the shipped code; it never loads the folder as
the unpatched base model.

Classes are made when first needed, for any model type: :func:`register_auto_classes` puts a mapping into
``AutoConfig``'s registry that makes ``QKNorm<Base>Config`` (and registers its model classes) the first time
Transformers looks up ``qknorm_<base>``, so importing the plugin imports no model code.
"""

from __future__ import annotations

from ..portable.autoclasses import heads_of_release, make_config_class, make_model_class, share_conversion_mapping
from ..portable.families import base_model_type
from ..portable.names import PREFIX
from ..portable.schemes import QKNormConfig

_CONFIGS: dict[str, type] = {}
_MODELS: dict[tuple[type, str], type] = {}  # (base model class, model type) -> patched subclass


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
    """``QKNorm<Base>Config`` for base ``model_type`` (created once, with its model classes registered)."""
    if model_type not in _CONFIGS:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        base = CONFIG_MAPPING[model_type]
        cls = make_config_class(base, model_type, __name__)
        share_conversion_mapping(model_type, _conversion_mapping())
        cls.save_pretrained = _saving_remote_code(cls)
        globals()[cls.__name__] = cls  # importable by name, so pickling and copying work
        _CONFIGS[model_type] = cls
        _register_heads(cls, base, model_type)
    return _CONFIGS[model_type]


def _conversion_mapping():
    try:
        from transformers import conversion_mapping
    except ImportError:  # a Transformers without conversion mappings
        return None
    return conversion_mapping


def _heads():
    from transformers.models.auto import modeling_auto

    return heads_of_release(modeling_auto)


def _register_heads(cls: type, base_cfg: type, model_type: str) -> None:
    import transformers
    from transformers.models.auto import modeling_auto

    for auto_name, mapping_name in _heads():
        mapping = getattr(modeling_auto, mapping_name)
        if base_cfg in mapping and hasattr(transformers, auto_name):
            head = mapping[base_cfg]
            if isinstance(head, type):
                getattr(transformers, auto_name).register(cls, model_class(head, model_type), exist_ok=True)


def model_class(base_cls: type, model_type: str) -> type:
    """``QKNorm<Base>`` twin of a model class (created once)."""
    key = (base_cls, model_type)  # model types can share a class (EXAONE's is Llama's), not a config class
    if key not in _MODELS:
        cls = make_model_class(base_cls, config_class(model_type), __name__)
        globals().setdefault(cls.__name__, cls)
        _share_class_mapping(base_cls.__name__, cls.__name__)
        _MODELS[key] = cls
    return _MODELS[key]


def _share_class_mapping(base_name: str, name: str) -> None:
    """A checkpoint conversion mapping Transformers keys by class name (Qwen2-VL's, which moves the language model's
    weights from ``model.layers`` to ``model.language_model.layers`` on loading, and back on saving) applies to
    ``QKNorm<Class>`` too, so a saved folder's weights load into the patched class where they came from."""
    module = _conversion_mapping()
    get = getattr(module, "get_checkpoint_conversion_mapping", None)
    register = getattr(module, "register_checkpoint_conversion_mapping", None)
    if get is None or register is None:
        return
    mapping = get(base_name)
    if mapping and not get(name):
        register(name, mapping)


def __getattr__(name: str):
    """``QKNorm<Base>Config`` / ``QKNorm<Head>`` by name (unpickling a patched model in a fresh process)."""
    from ..portable.names import CLASS_PREFIX

    if name.startswith(CLASS_PREFIX):
        from transformers.models.auto import modeling_auto
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

        base = name[len(CLASS_PREFIX) :]
        for model_type, class_name in CONFIG_MAPPING_NAMES.items():
            if class_name == base:
                return config_class(model_type)
        for _auto, mapping_name in _heads():
            types = [t for t, c in getattr(modeling_auto, mapping_name + "_NAMES").items() if c == base]
            types = [t for t in types if t in _CONFIGS] or types  # a class shared by types: the one in use
            if types:
                return model_class(getattr(modeling_auto, mapping_name)[CONFIG_MAPPING[types[0]]], types[0])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def mark_patched(config, cfg: QKNormConfig) -> None:
    """Record the scheme on a model's (own) config and make it a ``QKNorm<Base>Config``."""
    config.__class__ = config_class(base_model_type(config.model_type))
    config.qknorm = cfg.to_dict()


class _PatchedConfigs(dict):
    """``AutoConfig``'s registry of extra model types, which also knows every ``qknorm_<base>`` whose base
    Transformers knows: looking one up makes its classes (:func:`config_class`)."""

    def _known(self, key) -> bool:
        if not isinstance(key, str) or not key.startswith(PREFIX):
            return False
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        return base_model_type(key) in CONFIG_MAPPING_NAMES

    def __contains__(self, key) -> bool:
        return dict.__contains__(self, key) or self._known(key)

    def __getitem__(self, key):
        if not dict.__contains__(self, key) and self._known(key):
            config_class(base_model_type(key))
            dict.__setitem__(self, key, _CONFIGS[base_model_type(key)])
        return dict.__getitem__(self, key)

    def get(self, key, default=None):
        return self[key] if key in self else default


def register_auto_classes() -> None:
    """Make ``AutoConfig`` (and through it the Auto model classes) know every ``qknorm_<base>`` model type."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    extra = CONFIG_MAPPING._extra_content
    if not isinstance(extra, _PatchedConfigs):
        CONFIG_MAPPING._extra_content = _PatchedConfigs(extra)

"""Save/load support: ``qknorm_<base>`` config and model classes registered with the Auto classes.

A patched model's config becomes ``QKNorm<Base>Config`` (``model_type = "qknorm_<base>"``) carrying the scheme as
``config.qknorm``; ``save_pretrained`` writes both to ``config.json``. After ``import hf_qknorm``,
``AutoModelForCausalLM.from_pretrained(folder)`` builds ``QKNorm<Base>ForCausalLM``, which is the base class patched
in ``__init__`` from ``config.qknorm`` -- so the saved norm weights have somewhere to load into. Without the plugin,
Transformers does not know ``qknorm_<base>`` and refuses the folder loudly instead of dropping the norm weights.
"""

from __future__ import annotations

from torch import nn

from .families import FAMILIES

PREFIX = "qknorm_"

_CONFIGS: dict[str, type] = {}
_MODELS: dict[type, type] = {}  # base model class -> patched subclass


def _make_init(base_cls):
    def __init__(self, config, *args, **kwargs):
        base_cls.__init__(self, config, *args, **kwargs)
        _patch_from_config(self)

    return __init__


def _patch_from_config(model: nn.Module) -> None:
    from .patch import _apply, _mark_patched
    from .families import get_family
    from .schemes import QKNormConfig

    config = model.config
    cfg_dict = getattr(config, "qknorm", None)
    if cfg_dict is None:
        raise ValueError(f"{type(config).__name__} has no 'qknorm' entry: this config was not saved by hf_qknorm")
    cfg = QKNormConfig.from_dict(cfg_dict)
    family = get_family(config.model_type[len(PREFIX):])
    _apply(model, cfg, family)
    _mark_patched(model, cfg, family)


def config_class(model_type: str) -> type:
    """``QKNorm<Base>Config`` for base ``model_type`` (created once, registered with ``AutoConfig``)."""
    if model_type not in _CONFIGS:
        from transformers import AutoConfig
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        base = CONFIG_MAPPING[model_type]
        cls = type(f"QKNorm{base.__name__}", (base,), {"model_type": PREFIX + model_type, "__module__": __name__})
        globals()[cls.__name__] = cls  # importable by name, so pickling and copying work
        AutoConfig.register(PREFIX + model_type, cls, exist_ok=True)
        _CONFIGS[model_type] = cls
    return _CONFIGS[model_type]


def model_class(base_cls: type, model_type: str) -> type:
    """``QKNorm<Base>`` subclass of a model class: ``__init__`` builds the base model, then patches it."""
    if base_cls in _MODELS:
        return _MODELS[base_cls]
    cfg_cls = config_class(model_type)
    cls = type(f"QKNorm{base_cls.__name__}", (base_cls,),
               {"__init__": _make_init(base_cls), "config_class": cfg_cls, "__module__": __name__})
    globals()[cls.__name__] = cls
    _MODELS[base_cls] = cls
    _MODELS[cls] = cls
    return cls


def patched_classes(model_type: str, current_cls: type) -> tuple[type, type | None]:
    """The config class and model class a freshly patched model of ``current_cls`` takes on."""
    cfg_cls = config_class(model_type)
    if current_cls in _MODELS:
        return cfg_cls, _MODELS[current_cls]
    if getattr(current_cls, "config_class", None) is None:
        return cfg_cls, None
    return cfg_cls, model_class(current_cls, model_type)


def register_auto_classes() -> None:
    """Register ``qknorm_<base>`` with ``AutoConfig``, ``AutoModel`` and ``AutoModelForCausalLM`` for every family."""
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for model_type in FAMILIES:
        cfg_cls = config_class(model_type)
        base_cfg = CONFIG_MAPPING[model_type]
        for auto, mapping in ((AutoModelForCausalLM, MODEL_FOR_CAUSAL_LM_MAPPING), (AutoModel, MODEL_MAPPING)):
            auto.register(cfg_cls, model_class(mapping[base_cfg], model_type), exist_ok=True)

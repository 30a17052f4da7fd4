"""Configurations of folders saved by hf_qknorm, for loading them without the plugin (``trust_remote_code=True``).

Written into every saved ``qknorm_<base>`` folder beside the ``qknorm_*.py`` files it imports, which are the plugin's
own modules (``hf_qknorm/portable``). ``QKNorm<Base>Config`` is the base model type's configuration with its own
``model_type``, made on first use for whichever base the folder names; the scheme lives in ``config.qknorm``
(scheme, norm, softcap, eps, p) and is validated with the plugin's rules.
"""

from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

from .qknorm_autoclasses import make_config_class, share_conversion_mapping

# {SHIPPED_IMPORTS}
from .qknorm_names import CLASS_PREFIX

try:
    from transformers import conversion_mapping as _conversion_mapping
except ImportError:  # a Transformers without conversion mappings
    _conversion_mapping = None

CONFIG_CLASSES = {}
BASE_MODEL_TYPE = None  # {BASE_MODEL_TYPE}: the saved model's base model type, written in when it is saved


def config_class(model_type):
    """``QKNorm<Base>Config`` of base ``model_type`` (made once)."""
    if model_type not in CONFIG_CLASSES:
        cls = make_config_class(CONFIG_MAPPING[model_type], model_type, __name__)
        share_conversion_mapping(model_type, _conversion_mapping)
        CONFIG_CLASSES[model_type] = cls
        globals()[cls.__name__] = cls
    return CONFIG_CLASSES[model_type]


def __getattr__(name):
    if name.startswith(CLASS_PREFIX):
        base = name[len(CLASS_PREFIX) :]
        types = [t for t, class_name in CONFIG_MAPPING_NAMES.items() if class_name == base]
        types = [t for t in types if t == BASE_MODEL_TYPE] or types
        if types:
            return config_class(types[0])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

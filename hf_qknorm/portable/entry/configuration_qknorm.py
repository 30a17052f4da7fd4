"""Configurations of folders saved by hf_qknorm, for loading them without the plugin (``trust_remote_code=True``).

Written into every saved ``qknorm_<base>`` folder beside the ``qknorm_*.py`` files it imports, which are the plugin's
own modules (``hf_qknorm/modeling``). Each class is the base family's configuration with its own ``model_type``; the
scheme lives in ``config.qknorm`` (scheme, norm, softcap, eps, p) and is validated with the plugin's rules.
"""

from transformers.models.auto.configuration_auto import CONFIG_MAPPING

# {SHIPPED_IMPORTS}
from .qknorm_families import FAMILIES
from .qknorm_structure import make_config_class

CONFIG_CLASSES = {}
for _model_type in FAMILIES:
    CONFIG_CLASSES[_model_type] = make_config_class(CONFIG_MAPPING[_model_type], _model_type, __name__)
    globals()[CONFIG_CLASSES[_model_type].__name__] = CONFIG_CLASSES[_model_type]

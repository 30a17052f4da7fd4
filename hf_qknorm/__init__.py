"""hf_qknorm: QK-norm, softmax capping and QKV-norm for Hugging Face Transformers.

Importing the package registers the ``"qknorm"`` attention implementation (attention and mask functions) and the
``qknorm_<base>`` model types with Transformers' Auto classes.
"""

from .attention.interface import ATTN_IMPLEMENTATION, qknorm_attention_forward
from .attention.interface import register as _register_attention
from .conversion.converter import convert
from .modeling.families import FAMILIES, Family, get_family
from .modeling.classes import register_auto_classes as _register_auto_classes
from .training.monitor import QKMonitor, QKMonitorCallback, attention_stats
from .modeling.patch import is_patched, patch_model, qknorm_config
from .training.lora import lora_config, prepare_lora
from .training.qk_lr import QKLearningRate, QKLearningRateCallback, qk_param_groups
from .modeling.schemes import DEFAULT_SOFTCAP, NORMS, SCHEMES, QKNormConfig

__version__ = "0.1.0"

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DEFAULT_SOFTCAP",
    "FAMILIES",
    "Family",
    "NORMS",
    "QKLearningRate",
    "QKLearningRateCallback",
    "QKMonitor",
    "QKMonitorCallback",
    "QKNormConfig",
    "SCHEMES",
    "attention_stats",
    "convert",
    "get_family",
    "is_patched",
    "lora_config",
    "patch_model",
    "prepare_lora",
    "qk_param_groups",
    "qknorm_attention_forward",
    "qknorm_config",
]

_register_attention()
_register_auto_classes()

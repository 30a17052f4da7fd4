"""hf_qknorm: QK-norm, softmax capping and QKV-norm for Hugging Face Transformers.

Importing the package registers the ``"qknorm"`` attention implementation (attention and mask functions) and the
``qknorm_<base>`` model types with Transformers' Auto classes.
"""

from .attention import ATTN_IMPLEMENTATION, qknorm_attention_forward
from .attention import register as _register_attention
from .families import FAMILIES, Family, get_family
from .modeling import register_auto_classes as _register_auto_classes
from .patch import is_patched, patch_model, qknorm_config
from .schemes import DEFAULT_SOFTCAP, NORMS, SCHEMES, QKNormConfig

__version__ = "0.1.0"

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DEFAULT_SOFTCAP",
    "FAMILIES",
    "Family",
    "NORMS",
    "QKNormConfig",
    "SCHEMES",
    "get_family",
    "is_patched",
    "patch_model",
    "qknorm_attention_forward",
    "qknorm_config",
]

_register_attention()
_register_auto_classes()

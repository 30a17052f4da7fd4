"""Models saved by hf_qknorm, loadable with plain ``transformers`` through ``trust_remote_code=True``.

Written into every saved ``qknorm_<base>`` folder beside the ``qknorm_*.py`` files it imports, which are the plugin's
own modules (``hf_qknorm/modeling`` and ``hf_qknorm/attention``), so the folder computes exactly what the plugin
does: the base family's model with per-head norms on queries and keys (and values for ``qkv_norm``) applied by hooks
on the projections, **before** RoPE, an optional logit cap ``c * tanh(s / c)``, and for ``qkv_norm`` the
pre-attention norm removed (its gain is already folded into the saved projections). Imports only ``torch`` and
``transformers``.

A capped model needs an attention implementation that applies its cap: this module registers ``"qknorm"`` as a plain
capped attention that materialises the logits, unless the plugin (the ``hf_qknorm`` package, installed from its
source with ``pip install .``: fused kernels and a memory-lean path) registered it first.
"""

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.auto import modeling_auto
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

# {SHIPPED_IMPORTS}
from .configuration_qknorm import CONFIG_CLASSES
from .qknorm_eager import capped_eager_attention
from .qknorm_families import FAMILIES
from .qknorm_names import ATTN_IMPLEMENTATION
from .qknorm_structure import AUTO_HEADS, make_model_class

if ATTN_IMPLEMENTATION not in ALL_ATTENTION_FUNCTIONS.valid_keys():
    AttentionInterface.register(ATTN_IMPLEMENTATION, capped_eager_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)

for _model_type in FAMILIES:
    _base_config = CONFIG_MAPPING[_model_type]
    for _auto, _mapping in AUTO_HEADS:
        _mapping = getattr(modeling_auto, _mapping)
        if _base_config in _mapping:
            _cls = make_model_class(_mapping[_base_config], CONFIG_CLASSES[_model_type], __name__)
            globals()[_cls.__name__] = _cls

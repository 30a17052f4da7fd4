"""Models saved by hf_qknorm, loadable with plain ``transformers`` through ``trust_remote_code=True``.

Written into every saved ``qknorm_<base>`` folder beside the ``qknorm_*.py`` files it imports, which are the plugin's
own modules (``hf_qknorm/portable``), so the folder computes exactly what the plugin does: the base model with
per-head norms on queries and keys (and values for ``qkv_norm``) applied by hooks on the projections, **before**
RoPE, an optional logit cap ``c * tanh(s / c)``, and for ``qkv_norm`` the pre-attention norm removed (its gain is
already folded into the saved projections). ``QKNorm<Head>`` is made on first use for whichever head class the
folder names. Imports only ``torch`` and ``transformers``.

A capped model needs an attention implementation that applies its cap: this module registers ``"qknorm"`` as a plain
capped attention that materialises the logits, unless the plugin (the ``hf_qknorm`` package: fused kernels and a
memory-lean path) registered it first.
"""

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.auto import modeling_auto
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

# {SHIPPED_IMPORTS}
from .configuration_qknorm import BASE_MODEL_TYPE, config_class
from .qknorm_autoclasses import heads_of_release, make_model_class
from .qknorm_eager import capped_eager_attention
from .qknorm_names import ATTN_IMPLEMENTATION, CLASS_PREFIX

if ATTN_IMPLEMENTATION not in ALL_ATTENTION_FUNCTIONS.valid_keys():
    AttentionInterface.register(ATTN_IMPLEMENTATION, capped_eager_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)

_MODELS = {}


def __getattr__(name):
    if name.startswith(CLASS_PREFIX) and name not in _MODELS:
        base = name[len(CLASS_PREFIX) :]
        found = [
            (t, mapping_name)
            for _auto, mapping_name in heads_of_release(modeling_auto)
            for t, class_name in getattr(modeling_auto, mapping_name + "_NAMES").items()
            if class_name == base
        ]
        # Several model types can share a class (EXAONE's is Llama's, PP-Chart2Table's GOT-OCR2's, in another
        # mapping than the shared type's own): the folder's own first, from whichever mapping names it.
        found = [f for f in found if f[0] == BASE_MODEL_TYPE] or found
        if found:
            model_type, mapping_name = found[0]
            base_cls = getattr(modeling_auto, mapping_name)[CONFIG_MAPPING[model_type]]
            _MODELS[name] = make_model_class(base_cls, config_class(model_type), __name__)
            globals()[name] = _MODELS[name]
    if name in _MODELS:
        return _MODELS[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

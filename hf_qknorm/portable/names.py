"""The names a patched model is known by, in one place (shipped with the rest of :mod:`hf_qknorm.portable`).

``ATTN_IMPLEMENTATION`` is the attention backend's key in Transformers' ``AttentionInterface``; ``PREFIX`` makes a
patched model's ``model_type`` from its base's (``llama`` -> ``qknorm_llama``); ``CLASS_PREFIX`` its class names
(``LlamaForCausalLM`` -> ``QKNormLlamaForCausalLM``). Saved folders record all three, so they never change.
"""

ATTN_IMPLEMENTATION = "qknorm"
PREFIX = "qknorm_"
CLASS_PREFIX = "QKNorm"

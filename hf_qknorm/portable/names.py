"""The names a patched model is known by, in one place (shipped with the rest of :mod:`hf_qknorm.portable`).

``ATTN_IMPLEMENTATION`` is the attention backend's key in Transformers' ``AttentionInterface``; ``PREFIX`` makes a
patched model's ``model_type`` from its base's (``llama`` -> ``qknorm_llama``); ``CLASS_PREFIX`` its class names
(``LlamaForCausalLM`` -> ``QKNormLlamaForCausalLM``). Saved folders record all three, so they never change.
"""

ATTN_IMPLEMENTATION = "qknorm"
ROLES = ("q", "k", "v")  # the parts of attention a scheme normalises, in this order everywhere
# where a model without q/k norms of its own gets the scheme's (Family.norm_slot: the attribute for each role)
NORM_SLOTS = tuple(f"{role}_norm" for role in ROLES)
PREFIX = "qknorm_"
CLASS_PREFIX = "QKNorm"

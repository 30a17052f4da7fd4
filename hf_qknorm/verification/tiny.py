"""Tiny models of any model type, built from the type's own config class with small sizes (nothing downloaded).

The coverage table (:mod:`.coverage`) and the tests patch one of these per model type. Sizes are set through the
names Transformers' configs use for them; a config that names them otherwise keeps its own (and may be too big to
build, which the table reports).
"""

from __future__ import annotations

import torch

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB = 64, 4, 2, 16, 2, 256

# config attribute -> tiny value, applied where the config has the attribute.
SIZES = {
    "hidden_size": HIDDEN,
    "n_embd": HIDDEN,
    "d_model": HIDDEN,
    "intermediate_size": 128,
    "n_inner": 128,
    "ffn_hidden_size": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "num_hidden_layers": LAYERS,
    "n_layer": LAYERS,
    "num_layers": LAYERS,
    "num_attention_heads": HEADS,
    "n_head": HEADS,
    "num_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "vocab_size": VOCAB,
    "max_position_embeddings": 128,
    "n_positions": 128,
    "n_ctx": 128,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "top_k": 2,
    "sliding_window": 4,
    "first_k_dense_replace": 0,
    "rotary_dim": 8,
    "kv_channels": HEAD_DIM,
}


def tiny_config(model_type: str):
    """A small config of ``model_type`` (its config class with the sizes above), dropout off, one pad token."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    for name, value in SIZES.items():
        if isinstance(getattr(config, name, None), int) and not isinstance(getattr(config, name), bool):
            try:
                setattr(config, name, value)
            except AttributeError:  # a property derived from other sizes (Falcon's head_dim)
                pass
    stated = config.to_dict()
    for name, value in (("head_dim", HEAD_DIM), ("num_key_value_heads", KV_HEADS)):
        if name in stated and stated[name] is None:  # a config that derives it later states it
            try:
                setattr(config, name, value)
            except AttributeError:
                pass
    if getattr(config, "multi_query", False):
        config.num_key_value_heads = 1 if hasattr(config, "num_key_value_heads") else None
    # A per-layer list keeps one layer of each kind it names (sliding and full attention, a hybrid's recurrent layers),
    # so the tiny model has every kind of layer the real one has.
    kinds = getattr(config, "layer_types", None)
    keep = list(range(LAYERS))
    if isinstance(kinds, (list, tuple)) and kinds:
        first = {}
        for i, kind in enumerate(kinds):
            first.setdefault(kind, i)
        keep = sorted(first.values())
        keep += [i for i in range(len(kinds)) if i not in keep][: max(0, LAYERS - len(keep))]
        keep.sort()
        if hasattr(config, "num_hidden_layers"):
            try:
                config.num_hidden_layers = len(keep)
            except AttributeError:
                pass
    for name in ("layer_types", "attention_layer_types"):
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)) and value:
            setattr(config, name, [value[min(i, len(value) - 1)] for i in keep])
    value = getattr(config, "mlp_layer_types", None)
    if isinstance(value, (list, tuple)) and value:
        config.mlp_layer_types = list(value[: len(keep)]) + [value[-1]] * max(0, len(keep) - len(value))
    for name in dir(config):
        if "dropout" in name or name.endswith("_pdrop"):
            value = getattr(config, name, None)
            if isinstance(value, float):
                setattr(config, name, 0.0)
    if getattr(config, "pad_token_id", None) is not None and config.pad_token_id >= VOCAB:
        config.pad_token_id = 0
    for name in ("bos_token_id", "eos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value >= VOCAB:
            setattr(config, name, 1)
        elif isinstance(value, list):
            setattr(config, name, [v if v < VOCAB else 1 for v in value])
    return config


def tiny_model(model_type: str, dtype=torch.float32, seed: int = 0):
    """A randomly initialised tiny causal LM of ``model_type`` on the CPU, in eval mode, experts run eagerly."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(model_type)
    kwargs = {}
    if hasattr(config, "_experts_implementation"):
        kwargs["experts_implementation"] = "eager"
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    except TypeError:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()

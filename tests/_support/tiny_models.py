"""Tiny models of every supported family, built from configs (nothing is downloaded)."""

from __future__ import annotations

import torch

VOCAB = 128


def tiny_config(family: str, **overrides):
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    if family == "llama":
        cfg = LlamaConfig(**common)
    elif family == "mistral":
        cfg = MistralConfig(**common, sliding_window=12)
    elif family == "qwen2":
        cfg = Qwen2Config(**common)
    elif family == "qwen3":
        cfg = Qwen3Config(**{**common, "head_dim": 16})
    elif family == "gpt2":
        cfg = GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=128,
            attn_pdrop=0.0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
        )
    else:
        raise ValueError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def tiny_model(family: str, dtype=torch.float32, seed: int = 0, attn_implementation: str | None = None, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(family, **overrides)
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = AutoModelForCausalLM.from_config(cfg, **kwargs).to(dtype)
    model.eval()
    return model


FAMILY_NAMES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")


def kv_shared_gemma4():
    """A tiny Gemma 4 of three layers whose last reuses the keys and values an earlier full-attention layer stored
    (``num_kv_shared_layers=1``): no k/v projection of its own. Random weights (seed 0), eval mode."""
    from transformers import AutoModelForCausalLM

    from hf_qknorm.verification.tiny import tiny_config as tiny_config_of

    config = tiny_config_of("gemma4_text")
    wide = next(iter(config.to_dict()["per_layer_config"].values()))  # the full-attention layers' own sizes
    config.num_hidden_layers = 3
    config.layer_types = ["sliding_attention", "full_attention", "full_attention"]
    config.per_layer_config = {1: dict(wide), 2: dict(wide)}  # stated, so that a saved copy loads as this one
    config.num_kv_shared_layers = 1
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()

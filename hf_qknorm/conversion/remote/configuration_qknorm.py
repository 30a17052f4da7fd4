"""Configurations of checkpoints converted by hf_qknorm (https://github.com/hf-qknorm), for loading without it.

This file is copied into every folder that ``hf-qknorm convert`` exports as ``qknorm_<base>``, so that
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` works with plain ``transformers``. It must
import nothing but ``transformers``. Each class is the base family's configuration with its own ``model_type``; the
scheme lives in ``config.qknorm`` (a dict: scheme, norm, softcap, eps, p), as the plugin writes it.
"""

from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config


class QKNormLlamaConfig(LlamaConfig):
    model_type = "qknorm_llama"


class QKNormMistralConfig(MistralConfig):
    model_type = "qknorm_mistral"


class QKNormQwen2Config(Qwen2Config):
    model_type = "qknorm_qwen2"


class QKNormQwen3Config(Qwen3Config):
    model_type = "qknorm_qwen3"


class QKNormGPT2Config(GPT2Config):
    model_type = "qknorm_gpt2"


__all__ = ["QKNormGPT2Config", "QKNormLlamaConfig", "QKNormMistralConfig", "QKNormQwen2Config", "QKNormQwen3Config"]

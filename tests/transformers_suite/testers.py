"""Model testers: the config and inputs that drive Transformers' ``ModelTesterMixin``, one per family.

Written for this project in the spirit of Transformers' per-model testers (``LlamaModelTester``...), which the sdist
does not ship. The contract ``ModelTesterMixin`` relies on: ``prepare_config_and_inputs_for_common()`` returning
``(config, {"input_ids", "attention_mask"})``, ``get_config()``, and the sizes ``batch_size``, ``seq_length``,
``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``vocab_size``, ``is_training``.

A :class:`~variants.Variant` decides which config class the tester builds: the base config (the unpatched baseline)
or ``QKNorm<Base>Config`` carrying ``qknorm`` (what a saved patched folder holds), from which the ``QKNorm<Head>``
classes build patched models in ``__init__``.
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from tests.transformers_suite.variants import Variant

# Sizes as in Transformers' own testers (vocab 99, width 32, 2 layers, batch 13 x 7 tokens); 4 query heads over 2
# key/value heads, so GQA is exercised.
VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 99, 32, 2, 4, 2, 37
BATCH, SEQ = 13, 7


class DecoderTester:
    """Config and inputs for a decoder-only family. Subclasses say which config class and arguments."""

    model_type: str = ""
    num_labels = 3
    num_choices = 4
    type_sequence_label_size = 2

    def __init__(self, parent, variant: Variant):
        self.parent = parent
        self.variant = variant
        self.batch_size, self.seq_length = BATCH, SEQ
        self.vocab_size, self.hidden_size = VOCAB, HIDDEN
        self.num_hidden_layers, self.num_attention_heads = LAYERS, HEADS
        self.is_training = True
        self.pad_token_id = 0

    # -- config ------------------------------------------------------------------------------------------------------
    def base_config_class(self) -> type:
        raise NotImplementedError

    def config_kwargs(self) -> dict:
        raise NotImplementedError

    def config_class(self) -> type:
        return self.variant.config_class(self.model_type, self.base_config_class())

    def get_config(self):
        kwargs = self.config_kwargs()
        base = self.base_config_class()(**kwargs)
        qknorm = self.variant.qknorm_dict(base, self.model_type)
        return base if qknorm is None else self.config_class()(**kwargs, qknorm=qknorm)

    # -- inputs ------------------------------------------------------------------------------------------------------
    def prepare_config_and_inputs(self):
        import sys

        from tests.transformers_suite.upstream_tests import PACKAGE  # noqa: F401  (ids_tensor lives in the upstream module)

        ids_tensor = sys.modules[f"{PACKAGE}.test_modeling_common"].ids_tensor
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        # Left-truncated rows of different lengths (as Transformers' testers do), so padding is exercised.
        attention_mask = torch.tril(torch.ones(self.batch_size, self.seq_length, dtype=torch.long))
        return self.get_config(), input_ids, attention_mask

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, attention_mask = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": attention_mask}


class _RopeTester(DecoderTester):
    def config_kwargs(self) -> dict:
        return dict(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            intermediate_size=INTERMEDIATE,
            hidden_act="gelu",
            max_position_embeddings=512,
            initializer_range=0.02,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )


class LlamaTester(_RopeTester):
    model_type = "llama"

    def base_config_class(self):
        return LlamaConfig


class MistralTester(_RopeTester):
    model_type = "mistral"

    def base_config_class(self):
        return MistralConfig

    def config_kwargs(self):
        # A window shorter than the inputs, so the sliding-window mask is exercised.
        return {**super().config_kwargs(), "sliding_window": 4}


class Qwen2Tester(_RopeTester):
    model_type = "qwen2"

    def base_config_class(self):
        return Qwen2Config

    def config_kwargs(self):
        # Qwen2's per-layer windows: layer 0 full attention, layer 1 a window shorter than the inputs.
        return {**super().config_kwargs(), "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}


class Qwen3Tester(_RopeTester):
    model_type = "qwen3"

    def base_config_class(self):
        return Qwen3Config

    def config_kwargs(self):
        return {**super().config_kwargs(), "head_dim": HIDDEN // HEADS}


class GPT2Tester(DecoderTester):
    model_type = "gpt2"

    def __init__(self, parent, variant):
        super().__init__(parent, variant)
        self.pad_token_id = VOCAB - 1

    def base_config_class(self):
        return GPT2Config

    def config_kwargs(self):
        return dict(
            vocab_size=VOCAB,
            n_embd=HIDDEN,
            n_layer=LAYERS,
            n_head=HEADS,
            n_inner=INTERMEDIATE,
            activation_function="gelu",
            n_positions=512,
            initializer_range=0.02,
            resid_pdrop=0.1,
            embd_pdrop=0.1,
            attn_pdrop=0.1,
            bos_token_id=VOCAB - 1,
            eos_token_id=VOCAB - 1,
            pad_token_id=VOCAB - 1,
        )


class GenericTester(DecoderTester):
    """Any other model type: its own config class at the sizes of hf_qknorm's tiny models
    (:func:`hf_qknorm.verification.tiny.tiny_config`), with this suite's vocabulary and special tokens."""

    def base_config_class(self):
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        return CONFIG_MAPPING[self.model_type]

    def config_kwargs(self):
        from hf_qknorm.verification.tiny import tiny_config

        config = tiny_config(self.model_type)
        kwargs = {k: v for k, v in config.to_dict().items() if k not in _NOT_KWARGS}
        kwargs.update(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        self.hidden_size = kwargs.get("hidden_size", self.hidden_size)
        self.num_hidden_layers = kwargs.get("num_hidden_layers", self.num_hidden_layers)
        self.num_attention_heads = kwargs.get("num_attention_heads", self.num_attention_heads)
        return kwargs


_NOT_KWARGS = ("model_type", "transformers_version", "architectures", "_name_or_path", "dtype", "torch_dtype")

TESTERS: dict[str, type[DecoderTester]] = {
    t.model_type: t for t in (LlamaTester, MistralTester, Qwen2Tester, Qwen3Tester, GPT2Tester)
}


def make_tester(model_type: str) -> type[DecoderTester]:
    """The hand-written tester of the first five families, or a :class:`GenericTester` for ``model_type``."""
    if model_type in TESTERS:
        return TESTERS[model_type]
    return type(f"{model_type}Tester", (GenericTester,), {"model_type": model_type})

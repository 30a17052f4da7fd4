"""Per-family facts, as data: one row per supported ``model_type``.

Adding a family is one row here plus one case in ``tests/_support/tiny_models.py``. Nothing else in the package knows a
model family by name. This module imports nothing but the standard library: it is also copied into exported folders.
"""

from __future__ import annotations

from dataclasses import dataclass

from .names import PREFIX
from .schemes import check_eps

DEFAULT_EPS = 1e-6  # a new norm's epsilon when neither the scheme nor the model's config states one
DEFAULT_TRAINING_LENGTH = 2048  # the context length assumed when a config states none (Llama's original length)


@dataclass(frozen=True)
class Family:
    """What :func:`hf_qknorm.patch_model` needs to know about one model family.

    Attributes:
        model_type: the ``config.model_type`` of the family.
        attention_class: class name of the attention module (checked before patching).
        layers: dotted path from the ``*ForCausalLM`` module to the list of decoder blocks.
        attention: attribute of a decoder block holding the attention module.
        prenorm: attribute of a decoder block holding the pre-attention norm (removed by ``qkv_norm``).
        q_proj, k_proj, v_proj: projection attributes of the attention module; ``None`` when fused into ``qkv_proj``.
        qkv_proj: the fused projection attribute (GPT-2's ``c_attn``), or ``None``.
        out_proj: the output projection attribute.
        conv1d: projections are ``transformers.Conv1D`` (weight ``(in, out)``) rather than ``nn.Linear`` (``(out,
        in)``).
        rope: the family rotates q and k with RoPE (the norm goes before it).
        native_qk_norm: the family already has ``q_norm``/``k_norm`` (Qwen3's per-head RMSNorm).
        eps_attr: config attribute holding the model's own norm epsilon.
        max_len_attr: config attribute holding the training context length.
        final_norm: attribute of the base model holding the norm applied before the output head.
        base_model_attr: attribute of the ``*ForCausalLM`` holding the base model (used to name save classes).
    """

    model_type: str
    attention_class: str
    layers: str
    attention: str
    prenorm: str
    q_proj: str | None
    k_proj: str | None
    v_proj: str | None
    qkv_proj: str | None
    out_proj: str
    conv1d: bool
    rope: bool
    native_qk_norm: bool
    eps_attr: str
    max_len_attr: str
    final_norm: str = "norm"

    @property
    def fused_qkv(self) -> bool:
        return self.qkv_proj is not None

    @property
    def projections(self) -> dict[str, str]:
        """Role (``"q"``, ``"k"``, ``"v"``) -> projection attribute, for separate projections (empty when fused)."""
        if self.fused_qkv:
            return {}
        return {"q": self.q_proj, "k": self.k_proj, "v": self.v_proj}

    @property
    def patched_model_type(self) -> str:
        return PREFIX + self.model_type

    def norm_eps(self, config, hint: str = "") -> float:
        """The model's own norm epsilon: what a new norm uses unless the scheme states one. A value no norm can use
        (not finite, below float32's smallest normal) is refused, naming the config attribute (``hint`` adds how to
        override it)."""
        value = getattr(config, self.eps_attr, None)
        return check_eps(DEFAULT_EPS if value is None else value, f" (the model's own {self.eps_attr}{hint})")

    def training_length(self, config) -> int:
        """The context length the model was trained for, which sets the ``l2``/``lp`` logit scale's start (Henry
        et al.); :data:`DEFAULT_TRAINING_LENGTH` when the config states none. Patching and conversion both ask
        here, so a patched model and a converted one of the same settings start from the same norms."""
        value = getattr(config, self.max_len_attr, None)
        return int(DEFAULT_TRAINING_LENGTH if value is None else value)


def _rope_family(model_type: str, attention_class: str, native_qk_norm: bool = False) -> Family:
    return Family(
        model_type=model_type,
        attention_class=attention_class,
        layers="model.layers",
        attention="self_attn",
        prenorm="input_layernorm",
        q_proj="q_proj",
        k_proj="k_proj",
        v_proj="v_proj",
        qkv_proj=None,
        out_proj="o_proj",
        conv1d=False,
        rope=True,
        native_qk_norm=native_qk_norm,
        eps_attr="rms_norm_eps",
        max_len_attr="max_position_embeddings",
    )


FAMILIES: dict[str, Family] = {
    "llama": _rope_family("llama", "LlamaAttention"),
    "mistral": _rope_family("mistral", "MistralAttention"),
    "qwen2": _rope_family("qwen2", "Qwen2Attention"),
    "qwen3": _rope_family("qwen3", "Qwen3Attention", native_qk_norm=True),
    "gpt2": Family(
        model_type="gpt2",
        attention_class="GPT2Attention",
        layers="transformer.h",
        attention="attn",
        prenorm="ln_1",
        q_proj=None,
        k_proj=None,
        v_proj=None,
        qkv_proj="c_attn",
        out_proj="c_proj",
        conv1d=True,
        rope=False,
        native_qk_norm=False,
        eps_attr="layer_norm_epsilon",
        max_len_attr="n_positions",
        final_norm="ln_f",
    ),
}


def base_model_type(model_type) -> str:
    """``llama`` for ``llama`` and for ``qknorm_llama``."""
    model_type = str(model_type)
    return model_type[len(PREFIX) :] if model_type.startswith(PREFIX) else model_type


def check_saved_model_type(model_type, where) -> None:
    """A ``qknorm_<base>`` model type whose base this version has no family for -- a folder written by a newer
    hf_qknorm, or edited -- named in one line (Transformers would otherwise look for remote code and ask on stdin)."""
    model_type = str(model_type)
    if model_type.startswith(PREFIX) and base_model_type(model_type) not in FAMILIES:
        raise ValueError(
            f"{where}: model_type {model_type!r} names no family this hf_qknorm knows (it knows "
            f"{', '.join(PREFIX + f for f in sorted(FAMILIES))}); was it written by a newer hf_qknorm?"
        )


def family_of_config(config) -> Family:
    """The row of a (possibly patched) model's config."""
    return get_family(base_model_type(getattr(config, "model_type", None)))


def get_family(model_type: str) -> Family:
    """The row for ``model_type``, or a ``ValueError`` naming the supported families."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(
            f"unsupported model family {model_type!r}; hf_qknorm supports: {', '.join(sorted(FAMILIES))}. "
            "Adding a family is one row in hf_qknorm/portable/families.py."
        ) from None

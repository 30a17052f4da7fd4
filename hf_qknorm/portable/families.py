"""What patching needs to know about a model, derived from the model itself.

Families are derived, not listed: :func:`derive_family` reads a model's module tree -- the list of decoder
blocks, the attention module of a block, its q/k/v projections (separate or fused), its output projection, the
pre-attention norm and any q/k norm the model already has -- and its config's names for the norm epsilon and the
context length. What cannot be read off the structure is a :data:`QUIRKS` entry, keyed by ``model_type``: the head
layout of a fused projection, or a reason to refuse. Structure alone never makes a patch exact: after a patch is
installed, :mod:`hf_qknorm.modeling.selfcheck` runs a probe forward and refuses a model on which the scheme does not
reach the attention backend exactly (a model type nobody has tried included).

This module imports nothing but the standard library, ``torch`` and its siblings: it is also copied into exported
folders, where it derives the family of the model being loaded the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from .names import PREFIX, ROLES
from .schemes import check_eps

DEFAULT_EPS = 1e-6  # a new norm's epsilon when neither the scheme nor the model's config states one
DEFAULT_TRAINING_LENGTH = 2048  # the context length assumed when a config states none (Llama's original length)

# Names the attention modules of Transformers' decoders give their parts, in order of preference.
ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")
SEPARATE_NAMES = (("q_proj", "k_proj", "v_proj"),)
FUSED_NAMES = ("qkv_proj", "c_attn", "query_key_value", "Wqkv")
OUT_NAMES = ("o_proj", "c_proj", "dense", "out_proj")
PRENORM_NAMES = (
    "input_layernorm",
    "ln_1",
    "attention_norm",
    "attention_layernorm",
    "ln_attn",
    "self_attn_layer_norm",
    "norm_1",
)
FINAL_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "norm_f")
NATIVE_NORM_NAMES = {"q": ("q_norm", "q_layernorm"), "k": ("k_norm", "k_layernorm")}
EPS_ATTRS = ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_eps", "norm_epsilon")
MAX_LEN_ATTRS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")

# The model types whose attention math (Llama-style RoPE through the modelling file's apply_rotary_pos_emb or none,
# head_dim ** -0.5 scaling, a w * n(x) pre-norm) the telemetry's rebuild of q and k off the "qknorm" backend spells
# out. (The float64 verifier derives every type from its structure: hf_qknorm/verification/derive.py.)
SPELLED_OUT_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")

CONCAT, PER_HEAD = "concat", "per_head"  # layouts of a fused q/k/v projection's output

_DRAFTER = (
    "a draft model for Gemma 4's speculative decoding: every layer attends, both ways, over the keys and values its "
    "target model computed, and computes none of its own"
)

# What the structure does not say. ``layout``: a fused projection's output is per head ``[q_h k_h v_h]`` rather
# than ``[q | k | v]``; ``refuse``: a reason no probe can see (the model would compute something else silently).
QUIRKS: dict[str, dict] = {
    "gpt_neox": {"layout": PER_HEAD},
    "gpt_neox_japanese": {"layout": PER_HEAD},
    "persimmon": {"layout": PER_HEAD},
    "fuyu": {"layout": PER_HEAD},
    "codegen": {"refuse": "its fused qkv_proj interleaves q, k and v over model-parallel groups"},
    # its text layers' attention (query/key/value) is not one read off the structure; the only q/k/v stack found
    # would be its image encoder's
    "git": {"refuse": "its text decoder's attention (BERT-style query/key/value layers) is not one hf_qknorm patches"},
    "olmo": {"refuse_if": ("clip_qkv", "clamps q, k and v after the projections (config.clip_qkv)")},
    # attention by name only: out of scope
    "rwkv": {"scope": "no softmax self-attention (RWKV's time mixing is recurrent)"},
    "reformer": {"scope": "no softmax self-attention over the sequence (locality-sensitive hashing attention)"},
    "xlnet": {"scope": "no softmax self-attention of a causal decoder (a permutation language model)"},
    "pi0": {
        "scope": "not a language model (a vision-language-action model: its forward denoises robot actions with an "
        "action transformer attending to its language model's keys)"
    },
    "gemma4_assistant": {"scope": "not a language model of its own (" + _DRAFTER + ")"},
    "gemma4_unified_assistant": {"scope": "not a language model of its own (" + _DRAFTER + ")"},
    "diffusion_gemma_text": {
        "scope": "no softmax self-attention of a causal decoder (a block-diffusion language model: its decoder "
        "attends both ways)"
    },
}


class UnsupportedModelError(ValueError):
    """A model hf_qknorm cannot patch exactly, with the reason (one line, naming the model type)."""


@dataclass(frozen=True)
class Family:
    """What :func:`hf_qknorm.patch_model` needs to know about a model, read off its structure (``derive_family``):
    attribute names and dotted paths, each field described where it is declared."""

    model_type: str  # the (base) ``config.model_type``
    attention_class: str  # class name of the attention module
    layers: str  # dotted path from the ``*ForCausalLM`` module to the list of decoder blocks
    attention: str  # attribute of a decoder block holding the attention module
    prenorm: str | None  # attribute of a decoder block holding the pre-attention norm (``qkv_norm`` removes it)
    q_proj: str | None  # q, k, v projection attributes of the attention module; ``None`` when fused into qkv_proj
    k_proj: str | None
    v_proj: str | None
    qkv_proj: str | None  # the fused projection attribute (GPT-2's ``c_attn``), or ``None``
    out_proj: str  # the output projection attribute
    conv1d: bool  # projections are ``transformers.Conv1D`` (weight ``(in, out)``) rather than ``nn.Linear``
    rope: bool  # the model rotates q and k with RoPE
    # role -> attribute of a q/k norm the model already calls on each head before RoPE (Qwen3's ``q_norm``): the
    # scheme's norm takes its place
    native: dict = field(default_factory=dict)
    # role -> attribute of a q/k norm the model already has over the whole projection (OLMo 2's): kept, and the
    # scheme's per-head norm applied to its output
    kept: dict = field(default_factory=dict)
    fused_layout: str | None = None  # :data:`CONCAT` or :data:`PER_HEAD` for a fused projection, else ``None``
    eps_attr: str | None = None  # config attribute of the model's own norm epsilon (``None``: the pre-norm's own)
    max_len_attr: str | None = None  # config attribute of the training context length, or ``None``
    final_norm: str = "norm"  # attribute of the base model holding the norm applied before the output head
    prenorm_eps: float | None = None  # the pre-attention norm's epsilon, where the config states none
    # in a multimodal model, the dotted path to its language model (``model.language_model``), which the scheme
    # patches and whose config holds the sizes; ``None`` for a text model. ``layers`` then runs from the multimodal
    # model, and the other facts are the language model's
    text_model: str | None = None

    @property
    def fused_qkv(self) -> bool:
        return self.qkv_proj is not None

    @property
    def native_qk_norm(self) -> bool:
        """The model already normalises q and k per head (Qwen3): the scheme's norms take their place."""
        return bool(self.native)

    @property
    def projections(self) -> dict[str, str]:
        """Role (``"q"``, ``"k"``, ``"v"``) -> projection attribute, for separate projections (empty when fused)."""
        if self.fused_qkv:
            return {}
        return {"q": self.q_proj, "k": self.k_proj, "v": self.v_proj}

    @property
    def patched_model_type(self) -> str:
        return PREFIX + self.model_type

    def norm_slot(self, role: str) -> str:
        """The attention module's attribute holding the scheme's norm for ``role``: the native one it replaces, or
        ``q_norm``/``k_norm``/``v_norm``; a model that keeps its own whole-projection norm gets ``qknorm_q_norm``."""
        if role in self.native:
            return self.native[role]
        return f"qknorm_{role}_norm" if role in self.kept else f"{role}_norm"

    def norm_eps(self, config, hint: str = "") -> float:
        """The model's own norm epsilon: what a new norm uses unless the scheme states one. A value no norm can use
        (not finite, below float32's smallest normal) is refused, naming the config attribute (``hint`` adds how to
        override it)."""
        value = getattr(config, self.eps_attr, None) if self.eps_attr else None
        if value is None:
            value = self.prenorm_eps
        where = f"the model's own {self.eps_attr or 'pre-attention norm epsilon'}{hint}"
        return check_eps(DEFAULT_EPS if value is None else value, f" ({where})")

    def training_length(self, config) -> int:
        """The context length the model was trained for, which sets the ``l2``/``lp`` logit scale's start (Henry
        et al.); :data:`DEFAULT_TRAINING_LENGTH` when the config states none. Patching and conversion both ask
        here, so a patched model and a converted one of the same settings start from the same norms."""
        value = getattr(config, self.max_len_attr, None) if self.max_len_attr else None
        return int(DEFAULT_TRAINING_LENGTH if value is None else value)


def base_model_type(model_type) -> str:
    """``llama`` for ``llama`` and for ``qknorm_llama``."""
    model_type = str(model_type)
    return model_type[len(PREFIX) :] if model_type.startswith(PREFIX) else model_type


def _first(obj, names):
    return next((n for n in names if isinstance(getattr(obj, n, None), nn.Module)), None)


def _is_projection(module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D" or hasattr(module, "base_layer")


def _blocks(model: nn.Module) -> tuple[str, nn.ModuleList, str]:
    """``(path, blocks, attention attribute)`` of the one list of decoder blocks whose members hold an attention
    module with q/k/v projections; refuses a model with none, or with several (a hybrid or multimodal stack)."""
    found = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or not len(module):
            continue
        attrs = {_first(block, ATTENTION_NAMES) for block in module}
        attrs.discard(None)
        attns = [getattr(b, a, None) for b in module for a in attrs if hasattr(b, a)]
        whole = [bool(_attention_parts(x)) for x in attns]
        if attrs and any(whole) and all(w or _partial_attention(x) for w, x in zip(whole, attns)):
            found.append((path, module, attrs))
    model_type = getattr(model.config, "model_type", "?")
    if not found:
        raise UnsupportedModelError(_no_blocks_reason(model, model_type))
    if len(found) > 1:
        raise UnsupportedModelError(
            f"model type {model_type!r} has several stacks of attention blocks ({', '.join(f[0] for f in found)}); "
            "hf_qknorm patches decoder-only models with one stack"
        )
    path, blocks, attrs = found[0]
    lacking = [b for b in blocks if not isinstance(getattr(b, next(iter(attrs)), None), nn.Module)]
    if len(attrs) == 1 and any("cross" in name for b in lacking for name, _ in b.named_children()):
        raise UnsupportedModelError(
            f"model type {model_type!r} has cross-attention layers among its self-attention layers (Mllama's, to the "
            "image features); hf_qknorm patches stacks of self-attention layers"
        )
    if len(attrs) > 1 or lacking:
        raise UnsupportedModelError(
            f"model type {model_type!r} has blocks without self-attention (a hybrid model: some layers are "
            "recurrent, state-space or linear attention)"
        )
    return path, blocks, next(iter(attrs))


def _no_blocks_reason(model: nn.Module, model_type) -> str:
    """Why no decoder stack was found: an encoder (BERT's query/key/value), attention of another kind (multi-head
    latent attention, ...), or no attention at all (recurrent and state-space models)."""
    kinds = [type(m).__name__ for m in model.modules() if "Attention" in type(m).__name__]
    if any(all(isinstance(getattr(m, n, None), nn.Module) for n in ("query", "key", "value")) for m in model.modules()):
        return f"model type {model_type!r} is an encoder model (BERT-style self-attention); hf_qknorm patches decoders"
    nested = _nested_attention(model)
    if nested:
        return (
            f"model type {model_type!r}: its decoder blocks hold their attention below another module (.{nested}); "
            "hf_qknorm patches blocks whose attention module is a child of the block"
        )
    if _reuses_keys_or_values(model):
        return _reuse_reason(model_type)
    if any(_attention_parts(m) for m in model.modules()):  # q/k/v projections, but not in every block of a stack
        return (
            f"model type {model_type!r} is a hybrid model: some of its layers are recurrent, state-space or linear "
            "attention"
        )
    if kinds:
        return (
            f"model type {model_type!r}: its attention ({kinds[0]}) has no separate q_proj/k_proj/v_proj or fused "
            "q/k/v projection (multi-head latent attention and other forms are not supported)"
        )
    return f"model type {model_type!r}: no softmax self-attention (a recurrent or state-space model)"


def _config_int(config, name):
    """``config.<name>`` when it is a positive int (a per-layer attribute some configs refuse to give reads None)."""
    try:
        value = getattr(config, name, None)
    except Exception:
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _config_value(config, name):
    try:
        return getattr(config, name, None)
    except Exception:
        return None


def _nested_attention(model: nn.Module) -> str | None:
    """The path, relative to a block, of the attention module every block of a stack holds deeper than as a child
    (DBRX's ``norm_attn_norm.attn``), or ``None``."""
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or not len(module):
            continue
        paths = set()
        for block in module:
            found = [name for name, m in block.named_modules() if name and _attention_parts(m)]
            if len(found) != 1 or "." not in found[0]:
                break
            paths.add(found[0])
        else:
            if len(paths) == 1:
                return paths.pop()
    return None


def _reuse_reason(model_type) -> str:
    return (
        f"model type {model_type!r}: some of its attention layers have no key or value projection of their own "
        "(they reuse another layer's keys and values, or use the keys as values: num_kv_shared_layers, "
        "attention_k_eq_v), and its attention does not normalise q and k per head itself; hf_qknorm patches such "
        "layers only where the model's own q/k norms can be replaced (Gemma 3n, Gemma 4)"
    )


def _partial_attention(attn) -> bool:
    """Whether ``attn`` has a q and an output projection but not every one of k and v: a layer that reuses another
    layer's keys and values (Gemma 3n's and Gemma 4's KV-shared layers) or takes its values from its keys (Gemma 4's
    ``attention_k_eq_v`` layers, whose ``v_proj`` is ``None``)."""
    return (
        attn is not None
        and _attention_parts(attn) is None
        and all(_is_projection(getattr(attn, n, None)) for n in ("q_proj", "o_proj"))
    )


def own_roles(attn: nn.Module, family: Family) -> tuple[str, ...]:
    """The roles (``"q"``, ``"k"``, ``"v"``) ``attn`` projects itself: all three, except in a layer that reuses
    another layer's keys and values (q alone) or takes its values from its keys (q and k)."""
    if family.fused_qkv:
        return ROLES
    return tuple(r for r, name in family.projections.items() if _is_projection(getattr(attn, name, None)))


def reusing_layers(blocks, family: Family) -> tuple[int, ...]:
    """The indices of ``blocks`` whose attention has no key projection of its own (it attends over the keys and
    values an earlier layer stored: Gemma 3n's and Gemma 4's KV-shared layers)."""
    return tuple(i for i, block in enumerate(blocks) if "k" not in own_roles(getattr(block, family.attention), family))


def _reuses_keys_or_values(model: nn.Module) -> bool:
    """Whether some instances of an attention class of ``model`` have q/k/v projections and others of the same class
    only their query and output projections (Gemma 3n's and Gemma 4's KV-shared layers; Gemma 4's
    ``attention_k_eq_v`` layers, whose ``v_proj`` is ``None``) -- not a hybrid's other kind of layer, another class."""
    full, partial = set(), set()
    for module in model.modules():
        if _attention_parts(module):
            full.add(type(module))
        elif all(_is_projection(getattr(module, n, None)) for n in ("q_proj", "o_proj")):
            partial.add(type(module))
    return bool(full & partial)


def _attention_parts(attn) -> dict | None:
    """The projections of an attention module, or ``None`` when it has no recognisable q/k/v projections."""
    if attn is None:
        return None
    for names in SEPARATE_NAMES:
        if all(_is_projection(getattr(attn, n, None)) for n in names):
            return {"separate": names}
    fused = next((n for n in FUSED_NAMES if _is_projection(getattr(attn, n, None))), None)
    return {"fused": fused} if fused else None


def derive_family(model: nn.Module) -> Family:
    """The :class:`Family` of ``model`` (an unwrapped Transformers model, any head class, any device including
    ``meta``), read off its module tree and config; raises :class:`UnsupportedModelError` naming the model type
    and what is missing."""
    config = model.config
    model_type = base_model_type(getattr(config, "model_type", "?"))
    scope = type_out_of_scope(model_type)
    if scope:  # before its language model is looked for (pi0's is patchable alone)
        raise UnsupportedModelError(scope)
    path = None if getattr(config, "is_encoder_decoder", False) else text_model_path(model)
    if path is not None:
        return _multimodal_family(model, path)
    reason = out_of_scope(config)
    if reason:
        raise UnsupportedModelError(reason)
    quirk = QUIRKS.get(model_type, {})
    if "refuse" in quirk:
        raise UnsupportedModelError(f"model type {model_type!r}: {quirk['refuse']}")
    if "refuse_if" in quirk and getattr(config, quirk["refuse_if"][0], None):
        raise UnsupportedModelError(f"model type {model_type!r}: {quirk['refuse_if'][1]}")
    path, blocks, attention = _blocks(model)
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and getattr(model, "base_model", None) is model:
        path = f"{prefix}.{path}"  # a bare base model: name the blocks as the head model does
    block = blocks[0]
    attentions = [getattr(b, attention) for b in blocks]
    attn = next(a for a in attentions if _attention_parts(a))  # a layer with q/k/v projections of its own
    for other in blocks:
        if type(getattr(other, attention)) is not type(attn):
            raise UnsupportedModelError(
                f"model type {model_type!r} mixes attention classes across layers "
                f"({type(attn).__name__}, {type(getattr(other, attention)).__name__}): a hybrid model"
            )
    if getattr(attn, "config", None) is None:
        raise UnsupportedModelError(
            f"model type {model_type!r}: its attention module {type(attn).__name__} computes attention in its own "
            "code (it does not dispatch through Transformers' attention interface), which hf_qknorm cannot reach"
        )
    parts = _attention_parts(attn)
    out_proj = _first(attn, OUT_NAMES)
    if out_proj is None:
        raise UnsupportedModelError(f"model type {model_type!r}: no output projection in {type(attn).__name__}")
    separate = parts.get("separate") or (None, None, None)
    fused = parts.get("fused")
    anchor = getattr(attn, fused or separate[0])
    native, kept = {}, {}
    for role, names in NATIVE_NORM_NAMES.items():
        name = _first(attn, names)
        if name is None:
            continue
        weight = getattr(getattr(attn, name), "weight", None)
        width = None if weight is None else weight.shape[-1]
        if weight is not None and weight.dim() > 1:  # Chameleon's: a gain per head, (heads, head_dim)
            raise UnsupportedModelError(
                f"model type {model_type!r}: its own {role} norm ({type(attn).__name__}.{name}) has a gain per head "
                f"(weight {tuple(weight.shape)}), which the scheme's per-head norm (one gain shared by the heads) "
                "cannot take the place of"
            )
        if width is not None and width != head_dim_of(attn, config):
            kept[role] = name  # over the whole projection (OLMo 2): kept, the scheme's norm goes after it
        else:
            native[role] = name
    if any(not _attention_parts(a) for a in attentions) and (fused or kept or not {"q", "k"} <= native.keys()):
        raise UnsupportedModelError(_reuse_reason(model_type))
    if fused and kept:
        raise UnsupportedModelError(
            f"model type {model_type!r}: a fused q/k/v projection with a q/k norm over the whole projection"
        )
    prenorm = _first(block, PRENORM_NAMES)
    base = getattr(model, prefix, model) if prefix else model
    eps_attr = next((a for a in EPS_ATTRS if isinstance(_config_value(config, a), (int, float))), None)
    prenorm_eps = None
    if prenorm is not None:
        module = getattr(block, prenorm)
        prenorm_eps = next(
            (float(v) for v in (getattr(module, a, None) for a in ("eps", "variance_epsilon")) if v is not None),
            None,
        )
    return Family(
        model_type=model_type,
        attention_class=type(attn).__name__,
        layers=path,
        attention=attention,
        prenorm=prenorm,
        q_proj=separate[0],
        k_proj=separate[1],
        v_proj=separate[2],
        qkv_proj=fused,
        out_proj=out_proj,
        conv1d=type(getattr(anchor, "base_layer", anchor)).__name__ == "Conv1D",
        rope=any(n.endswith("rotary_emb") for n, _ in model.named_modules()),
        native=native,
        kept=kept,
        fused_layout=(quirk.get("layout", CONCAT) if fused else None),
        eps_attr=eps_attr,
        max_len_attr=next((a for a in MAX_LEN_ATTRS if _config_int(config, a)), None),
        final_norm=_first(base, FINAL_NORM_NAMES) or "norm",
        prenorm_eps=prenorm_eps,
    )


def text_model_path(model: nn.Module) -> str | None:
    """The dotted path to the language model of a multimodal model, or ``None`` for a text model (one whose config is
    its own text config). The language model is found from the structure, not from a table: the outermost
    submodule that is a model of its own (it has a ``base_model_prefix``) and holds the config's text config
    (``config.get_text_config()``) -- ``model.language_model`` in LLaVA, Qwen2-VL or PaliGemma, ``model.text_model``
    in Idefics3 and SmolVLM, ``language_model`` (a causal LM) in Llama 4. Raises :class:`UnsupportedModelError` when
    a multimodal model holds no such submodule."""
    config = model.config
    text = text_config_of(config)
    if text is config:
        return None
    models = [(name, m) for name, m in model.named_modules() if name and hasattr(m, "base_model_prefix")]
    found = [name for name, m in models if m.__dict__.get("config") is text]
    if not found:  # a config copied on the way in: the same model type, as a last resort
        kind = getattr(text, "model_type", None)
        found = [name for name, m in models if getattr(getattr(m, "config", None), "model_type", 0) == kind]
    outer = sorted({n for n in found if not any(n.startswith(o + ".") for o in found)}, key=len)
    if len(outer) != 1:
        where = f"several ({', '.join(outer)})" if outer else "none"
        raise UnsupportedModelError(
            f"model type {getattr(config, 'model_type', '?')!r} is a multimodal model whose language model "
            f"(text config {getattr(text, 'model_type', '?')!r}) hf_qknorm cannot find: {where} of its submodules "
            "holds the text config"
        )
    return outer[0]


def text_forward_path(model: nn.Module) -> str | None:
    """Where a forward on text alone runs in ``model``: ``None`` for the model itself, or the path of a multimodal
    model's language model that is a causal LM of its own whose output head is the whole model's (BLIP-2's and
    InstructBLIP's OPT, Kosmos-2's text model). Such a model's logits are its language model's, and its own forward
    may need images (BLIP-2's takes no text alone), so text is run on the language model."""
    try:
        path = text_model_path(model)
    except UnsupportedModelError:
        return None
    if path is None:
        return None
    inner = model.get_submodule(path)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    whole = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return path if head is not None and head is whole else None


def text_runner(model: nn.Module) -> nn.Module:
    """The module a forward on text alone is run on: ``model``, or its language model (:func:`text_forward_path`)."""
    path = text_forward_path(model)
    return model if path is None else model.get_submodule(path)


def _multimodal_family(model: nn.Module, path: str) -> Family:
    """The family of a multimodal model: its language model's, with ``layers`` from the multimodal model and
    ``text_model`` set. A refusal of the language model names the multimodal type too."""
    inner = model.get_submodule(path)
    try:
        family = derive_family(inner)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(
            f"model type {getattr(model.config, 'model_type', '?')!r} (multimodal), its language model .{path}: {exc}"
        ) from None
    blocks = _blocks(inner)[1]
    layers = next(name for name, m in model.named_modules() if m is blocks)
    return replace(family, layers=layers, text_model=path)


def text_config_of(config):
    """A multimodal config's text config (whose sizes its language model's attention modules have), else itself --
    also where Transformers finds several text configs (an encoder and a decoder, as MusicGen's) and refuses to pick."""
    if not hasattr(config, "get_text_config"):
        return config
    try:
        return config.get_text_config()
    except ValueError:  # ambiguous: no one language model to patch
        return config


def head_dim_of(attn: nn.Module, config) -> int:
    """The per-head width of an attention module: its own ``head_dim``, the config's, or hidden size / heads."""
    config = text_config_of(config)
    for value in (getattr(attn, "head_dim", None), _config_int(config, "head_dim")):
        if isinstance(value, int) and value > 0:
            return value
    heads = heads_of(attn, config)[0]
    hidden = _config_int(config, "hidden_size") or _config_int(config, "n_embd")
    return int(hidden) // heads


def heads_of(attn: nn.Module, config) -> tuple[int, int]:
    """``(query heads, key/value heads)`` of an attention module, for the whole model (not one rank's share)."""
    config = text_config_of(config)
    heads = None
    for name in ("num_attention_heads", "n_head", "num_heads"):
        heads = _config_int(config, name)
        if heads:
            break
    heads = heads or getattr(attn, "num_heads", None) or getattr(attn, "num_attention_heads", None)
    own = getattr(attn, "num_heads", None)
    if isinstance(own, int) and 0 < own != heads and _query_width(attn) == own * _own_head_dim(attn, config):
        heads = own  # a per-layer head count the module was built with (Laguna's), its q projection that wide
    if getattr(config, "multi_query", False):
        return int(heads), 1
    kv = _config_int(config, "num_key_value_heads") or getattr(attn, "num_key_value_heads", None) or heads
    return int(heads), int(kv)


def _query_width(attn: nn.Module) -> int | None:
    """The output width of ``attn``'s separate q projection (a peft layer's base layer; a DTensor's global width), or
    ``None`` where it has none of the names :data:`SEPARATE_NAMES` gives one."""
    for name in (names[0] for names in SEPARATE_NAMES):
        proj = attn._modules.get(name)
        weight = getattr(getattr(proj, "base_layer", proj), "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            return int(weight.shape[0])
    return None


def _own_head_dim(attn: nn.Module, config) -> int:
    value = getattr(attn, "head_dim", None)
    return value if isinstance(value, int) and value > 0 else (_config_int(config, "head_dim") or 0)


def family_of_model(model: nn.Module) -> Family:
    """The family of an unwrapped model, derived once and kept on the model."""
    cached = model.__dict__.get("_qknorm_family")
    if cached is None:
        cached = derive_family(model)
        model.__dict__["_qknorm_family"] = cached
    return cached


def type_out_of_scope(model_type: str) -> str | None:
    """Why every model of ``model_type`` is outside what hf_qknorm patches, known from the type alone (before any
    config is built: a drafter's default config does not validate), or ``None``."""
    model_type = base_model_type(model_type)
    if "scope" in QUIRKS.get(model_type, {}):
        return f"model type {model_type!r}: {QUIRKS[model_type]['scope']}"
    return None


def out_of_scope(config) -> str | None:
    """Why a config's model is outside what hf_qknorm patches (decoder-only, softmax attention, text), or ``None``."""
    model_type = base_model_type(getattr(config, "model_type", "?"))
    if getattr(config, "is_encoder_decoder", False):
        return f"model type {model_type!r} is an encoder-decoder model; hf_qknorm patches decoder-only models"
    scope = type_out_of_scope(model_type)
    if scope:  # attention by name only: known from the type, before any model
        return scope
    text = text_config_of(config)
    if text is not config:  # a model in hand is patched through its language model (derive_family); a config is not
        return (
            f"model type {model_type!r} is a multimodal model: hf_qknorm.patch_model(model) patches its language "
            f"model ({getattr(text, 'model_type', '?')!r}) in place; tools that take a model type or config take "
            "text models only"
        )
    if getattr(config, "is_decoder", True) is False and "bert" in model_type:
        return f"model type {model_type!r} is an encoder model; hf_qknorm patches decoder-only models"
    return None

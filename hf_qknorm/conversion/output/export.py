"""What a converted folder looks like to people who never install hf_qknorm.

Three formats:

- ``qwen3``: a Llama or Mistral patched with ``rmsnorm`` ``qk_norm`` *is* a Qwen3 model (per-head RMSNorm on q and k
  before RoPE, same state-dict names), so it is written as a plain ``qwen3`` folder that vanilla Transformers loads
  with identical logits. :func:`qwen3_blocker` says why a model cannot be written this way (an ``mlp_bias``, a
  norm epsilon that differs from the model's, another scheme...).
- ``native``: a model with per-head q/k norms of its own (Qwen3, Qwen3-MoE, Gemma 3, Persimmon, ...) whose own
  norm computes exactly the scheme's norm (``qk_norm`` with ``rmsnorm`` for an RMS norm, ``layernorm`` for a
  LayerNorm, the same epsilon) is still a model of its own type after the conversion: only its q/k norm gains
  change. It is written as the source's own model type, each gain stored in the model's own convention (Gemma's
  ``1 + w`` as ``w``); :func:`native_form` finds the convention by probing the model's norm, and says why not.
- ``qknorm``: everything else is written as ``model_type: qknorm_<base>`` with ``auto_map`` pointing at the remote
  code every patched config saves beside itself (:mod:`hf_qknorm.modeling.remote`: the plugin's own modules), so
  that ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` works without the plugin, and
  ``from_pretrained(folder)`` works after ``import hf_qknorm``.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from ...portable.families import Family, base_model_type, text_config_of
from ...portable.schemes import QKNormConfig

EXPORTS = ("auto", "qwen3", "native", "qknorm")
PLAIN = ("qwen3", "native")  # formats that load in plain Transformers

# Files carried over from the source folder besides the weights and config (tokenizer, generation config, licence).
# The files that make up a tokenizer (copied with SIDE_FILE_PATTERNS): a folder without any has none.
TOKENIZER_PATTERNS = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "vocab.*",
    "merges.txt",
    "*.tiktoken",
    "spiece.model",
)
SIDE_FILE_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    "chat_template.*",
    "generation_config.json",
    "preprocessor_config.json",
    "LICENSE*",
    "LICENCE*",
    "NOTICE*",
    "USE_POLICY*",
)


def qwen3_blocker(config, cfg: QKNormConfig, family: Family) -> str | None:
    """``None`` when the patched model is exactly a Qwen3 model -- for a multimodal model: its language model, in a
    model that takes a language model of any type (LLaVA, Mistral3) -- else the reason it is not."""
    if family.model_type not in ("llama", "mistral"):
        return f"only Llama and Mistral models become Qwen3 models, this is {family.model_type!r}"
    text = text_config_of(config)
    if text is not config:
        from transformers import AutoConfig

        if type(config).sub_configs.get("text_config") is not AutoConfig:
            return (
                f"the language model of a {config.model_type!r} model is of its own fixed type "
                f"({type(text).__name__}), not one a Qwen3 language model can take the place of"
            )
        config = text
    if cfg.scheme != "qk_norm" or cfg.norm != "rmsnorm":
        return (
            f"Qwen3 is scheme 'qk_norm' with norm 'rmsnorm' (no cap, no value norm); "
            f"this conversion is scheme {cfg.scheme!r} with norm {cfg.norm!r}"
        )
    if getattr(config, "mlp_bias", False):
        return "the source has mlp_bias=True and Qwen3's MLP has no biases"
    if cfg.eps is not None and float(cfg.eps) != float(config.rms_norm_eps):
        return (
            f"Qwen3's q/k norms use the model's rms_norm_eps ({config.rms_norm_eps:g}), "
            f"but the conversion asked for eps={cfg.eps:g}"
        )
    if getattr(config, "rope_parameters", None) is None:
        return "the source config has no rope parameters Qwen3 can take"
    return None


def qwen3_config(config, dtype: torch.dtype):
    """The ``Qwen3Config`` of a Llama/Mistral ``config`` (the patched model's own config or the source's)."""
    from transformers import Qwen3Config

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    window = getattr(config, "sliding_window", None) if base_model_type(config.model_type) == "mistral" else None
    layers = config.num_hidden_layers
    return Qwen3Config(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=head_dim,
        hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.initializer_range,
        rms_norm_eps=config.rms_norm_eps,
        use_cache=config.use_cache,
        tie_word_embeddings=config.tie_word_embeddings,
        rope_parameters=dict(config.rope_parameters),
        attention_bias=getattr(config, "attention_bias", False),
        # Mistral's window applies to every layer; Qwen3 applies it to layers >= max_window_layers
        use_sliding_window=window is not None,
        sliding_window=window,
        max_window_layers=0,
        layer_types=["sliding_attention" if window is not None else "full_attention"] * layers,
        attention_dropout=config.attention_dropout,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        architectures=["Qwen3ForCausalLM"],
        dtype=dtype,
    )


def native_form(source, cfg: QKNormConfig) -> tuple[dict | None, str | None]:
    """``(offsets, None)`` when the converted model is still a model of the source's own type -- its own per-head q
    and k norms compute exactly the scheme's norm, with the gains the conversion sets stored as ``gain - offset``
    (``offsets``: parameter name -> offset, e.g. ``{"weight": 1.0}`` for Gemma's ``1 + w``) -- else ``(None,
    reason)``. ``source``: a :class:`~hf_qknorm.conversion.orchestration.source.Source`."""
    family = source.family
    if set(family.native) != {"q", "k"}:
        return None, f"model type {family.model_type!r} has no per-head q/k norms of its own the scheme's could be"
    if cfg.scheme != "qk_norm" or cfg.norm not in ("rmsnorm", "layernorm"):
        return None, (
            f"the model's own q/k norms are the scheme 'qk_norm' (no cap, no value norm); this conversion is "
            f"scheme {cfg.scheme!r} with norm {cfg.norm!r}"
        )
    from ...portable.families import head_dim_of
    from ...portable.layout import find_layers
    from .forms import materialised
    from .shards import skeleton

    model = skeleton(source.config)
    attn = getattr(find_layers(model, family)[0], family.attention)
    head_dim = head_dim_of(attn, model.config)
    offsets = None
    for role in ("q", "k"):
        name = family.native[role]
        module = materialised(attn._modules[name], f"{family.layers}.0.{family.attention}.{name}", source.weights)
        found = _offsets(module, cfg, head_dim)
        if found is None or (offsets is not None and found != offsets):
            return None, (
                f"the model's own {name} ({type(module).__name__}) does not compute the scheme's {cfg.norm} with "
                f"eps={cfg.eps:g}"
            )
        offsets = found
    return offsets, None


@torch.no_grad()
def _offsets(module, cfg: QKNormConfig, head_dim: int) -> dict | None:
    """The offsets with which ``module`` (a model's own per-head norm) stores the scheme's norm parameters
    (``module`` with ``weight = g - offset`` computes the scheme's norm with gain ``g``), or ``None`` when it
    computes something else for some gain, bias or input scale (the epsilon shows at inputs of its size)."""
    import copy

    from ...portable.norms import make_norm

    ref = make_norm(cfg.norm, "q", head_dim, cfg.eps).double()
    mine = copy.deepcopy(module).double()
    names = {n for n, _ in mine.named_parameters()}
    if names != {n for n, _ in ref.named_parameters()}:
        return None
    gen = torch.Generator().manual_seed(0)
    for offset in (0.0, 1.0):
        ok = True
        for _ in range(2):
            values = {n: 0.3 * torch.randn(head_dim, generator=gen, dtype=torch.float64) for n in names}
            values["weight"] = values["weight"] + 1.0
            for n, v in values.items():
                getattr(ref, n).copy_(v)
                getattr(mine, n).copy_(v - offset if n == "weight" else v)
            for scale in (1.0, math.sqrt(cfg.eps)):
                x = scale * torch.randn(2, 3, 4, head_dim, generator=gen, dtype=torch.float64)
                got, want = mine(x).double(), ref(x)
                ok = ok and bool(torch.allclose(got, want, rtol=1e-5, atol=1e-7 * float(want.abs().max())))
        if ok:
            return {"weight": offset}
    return None


def resolve_export(export: str, config, cfg: QKNormConfig, family: Family, source=None) -> tuple[str, str | None]:
    """``(kind, reason)``: the format to write (``"qwen3"``, ``"native"`` or ``"qknorm"``) and why a plain format
    was not taken where one was possible in principle (``None`` otherwise). ``export="qwen3"`` or ``"native"`` on a
    model that is not one is an error. ``source`` (a :class:`~hf_qknorm.conversion.orchestration.source.Source`) is
    needed to consider ``native``."""
    if export not in EXPORTS:
        raise ValueError(f"unknown export {export!r}; choose one of {', '.join(EXPORTS)}")
    if export in ("auto", "native") and family.native and source is not None:
        offsets, blocker = native_form(source, cfg)
        if offsets is not None:
            return "native", None
        if export == "native":
            raise ValueError(
                f"cannot export as a plain {family.model_type} model: {blocker}. Use export='qknorm' (or 'auto')"
            )
        return "qknorm", (blocker if cfg.scheme == "qk_norm" else None)
    if export == "native":
        raise ValueError(
            f"cannot export as a plain {family.model_type} model: model type {family.model_type!r} has no per-head "
            "q/k norms of its own the scheme's could be. Use export='qknorm' (or 'auto')"
        )
    blocker = qwen3_blocker(config, cfg, family)
    if export == "qwen3":
        if blocker is not None:
            raise ValueError(f"cannot export as a plain qwen3 model: {blocker}. Use export='qknorm' (or 'auto')")
        return "qwen3", None
    if export == "auto" and blocker is None:
        return "qwen3", None
    return "qknorm", blocker if family.model_type in ("llama", "mistral") else None


def stored_values(values: dict, offsets: dict, family: Family, weights) -> dict:
    """``values`` (state-dict names) with those of the model's own q/k norms as the model stores them
    (``gain - offset``; a gain the conversion left as it was, the source's own tensor bit for bit); other tensors
    (healed projections) unchanged. ``weights``: the source's
    :class:`~hf_qknorm.conversion.output.shards.SourceWeights`."""
    slots = set(family.native.values())
    out = {}
    for name, value in values.items():
        owner, leaf = name.rsplit(".", 2)[-2:]
        offset = offsets.get(leaf, 0.0)
        if owner in slots and weights.has(name):
            own = weights.read_param(name)
            value = own if torch.equal(value, own.float() + offset) else value - offset
        out[name] = value
    return out


def write_config(folder: Path, kind: str, patched_config, dtype: torch.dtype, source_config=None) -> dict:
    """Write ``config.json`` for ``kind`` (``qknorm`` also gets the remote code; ``native`` is the source's
    ``source_config``; ``qwen3`` of a multimodal model is the source's with a Qwen3 text config). Returns the written
    dict."""
    import copy

    folder = Path(folder)
    if kind == "qwen3" and text_config_of(source_config) is not source_config:
        # a multimodal model whose language model becomes a Qwen3 model: the source's config around it
        config = copy.deepcopy(source_config)
        config.text_config = qwen3_config(text_config_of(patched_config), dtype)
        config.text_config.architectures = None
        config.dtype = dtype
        config.save_pretrained(folder)
        return json.loads((folder / "config.json").read_text())
    if kind == "qwen3":
        qwen3_config(patched_config, dtype).save_pretrained(folder)
        return json.loads((folder / "config.json").read_text())
    if kind == "native":
        config = copy.deepcopy(source_config)
        config.dtype = dtype
        config.save_pretrained(folder)
        return json.loads((folder / "config.json").read_text())
    patched_config.dtype = dtype
    patched_config.save_pretrained(folder)  # a QKNorm<Base>Config: writes the remote code and auto_map too
    return json.loads((folder / "config.json").read_text())


def has_tokenizer(folder: Path) -> bool:
    """Whether ``folder`` holds tokenizer files (:data:`TOKENIZER_PATTERNS`)."""
    return any(p.is_file() for pattern in TOKENIZER_PATTERNS for p in Path(folder).glob(pattern))


def check_tokenizer_fits(folder: Path, config) -> None:
    """Refuse a source whose tokenizer has more tokens than the embedding has rows: ids past the last row index
    nothing (an IndexError on CUDA as a device assert, mid-training), and the pair is most likely mixed up. Fewer
    tokens than rows is normal (vocabularies padded to a multiple of 64)."""
    from transformers import AutoTokenizer

    rows = getattr(config, "vocab_size", None)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception:  # noqa: BLE001 -- an unloadable tokenizer is reported where it is needed (calibration)
        return
    if isinstance(rows, int) and len(tokenizer) > rows:
        raise ValueError(
            f"the tokenizer in {folder} has {len(tokenizer):,} tokens but the embedding has "
            f"{rows:,} rows (vocab_size in config.json, checked against the weights): ids from {rows:,} "
            "up index nothing; is it the tokenizer this model was trained with?"
        )


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy tokenizer, generation config and licence files from ``src`` to ``dst``; returns their names."""
    copied = []
    for pattern in SIDE_FILE_PATTERNS:
        for path in sorted(Path(src).glob(pattern)):
            if path.is_file() and path.name not in copied and not path.name.endswith((".safetensors", ".bin")):
                shutil.copyfile(path, Path(dst) / path.name)
                copied.append(path.name)
    return copied

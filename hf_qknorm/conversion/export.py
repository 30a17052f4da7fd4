"""What a converted folder looks like to people who never install hf_qknorm.

Two formats:

- ``qwen3``: a Llama or Mistral patched with ``rmsnorm`` ``qk_norm`` *is* a Qwen3 model (per-head RMSNorm on q and k
  before RoPE, same state-dict names), so it is written as a plain ``qwen3`` folder that vanilla Transformers loads
  with identical logits. :func:`qwen3_blocker` says why a model cannot be written this way (an ``mlp_bias``, a
  norm epsilon that differs from the model's, another scheme...).
- ``qknorm``: everything else is written as ``model_type: qknorm_<base>`` with ``auto_map`` pointing at the remote
  code every patched config saves beside itself (:mod:`hf_qknorm.modeling.remote`: the plugin's own modules), so
  that ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` works without the plugin, and
  ``from_pretrained(folder)`` works after ``import hf_qknorm``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..portable.families import Family, base_model_type
from ..portable.schemes import QKNormConfig

EXPORTS = ("auto", "qwen3", "qknorm")

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
    """``None`` when the patched model is exactly a Qwen3 model, else the reason it is not."""
    if family.model_type not in ("llama", "mistral"):
        return f"only Llama and Mistral models become Qwen3 models, this is {family.model_type!r}"
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


def resolve_export(export: str, config, cfg: QKNormConfig, family: Family) -> tuple[str, str | None]:
    """``(kind, reason)``: the format to write (``"qwen3"`` or ``"qknorm"``) and, when ``qwen3`` was possible
    in principle but not taken, why. ``export="qwen3"`` on a model that is not a Qwen3 model is an error."""
    if export not in EXPORTS:
        raise ValueError(f"unknown export {export!r}; choose one of {', '.join(EXPORTS)}")
    blocker = qwen3_blocker(config, cfg, family)
    if export == "qwen3":
        if blocker is not None:
            raise ValueError(f"cannot export as a plain qwen3 model: {blocker}. Use export='qknorm' (or 'auto')")
        return "qwen3", None
    if export == "auto" and blocker is None:
        return "qwen3", None
    return "qknorm", blocker


def write_config(folder: Path, kind: str, patched_config, dtype: torch.dtype) -> dict:
    """Write ``config.json`` for ``kind`` (``qknorm`` also gets the remote code). Returns the written dict."""
    folder = Path(folder)
    if kind == "qwen3":
        qwen3_config(patched_config, dtype).save_pretrained(folder)
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

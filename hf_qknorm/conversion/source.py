"""The source of a conversion: a local folder or a Hub id, its config, family and weight files (nothing heavy read)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..modeling.derive import get_family
from ..modeling.saved import read_config
from ..portable.families import SPELLED_OUT_TYPES, Family, UnsupportedModelError
from ..portable.names import PREFIX
from .shards import SourceWeights, check_matches_config, read_source_weights

__all__ = ["Source", "inspect_source", "resolve_source"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class Source:
    path: Path
    name: str  # Hub id or folder name, for the model card's base_model
    config: object
    family: Family
    weights: SourceWeights


def resolve_source(src) -> tuple[Path, str]:
    """A local folder, or a Hub id downloaded with ``huggingface_hub`` where the Hub is reachable."""
    if src is None:
        from ..data import bundled_model_dir

        path = bundled_model_dir()
        return path, "hf_qknorm/tiny-llama (bundled)"
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"source {str(src)!r} is a file; give the folder that holds config.json")
        return path.resolve(), path.resolve().name
    if isinstance(src, str) and _HUB_ID.match(src) and not src.startswith((".", "/")):
        return _download(src), src
    raise FileNotFoundError(f"source folder not found: {str(src)!r}")


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "tokenizer*", "README.md", "LICENSE*"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as exc:  # offline, unknown repo, gated...: say which and why
        raise FileNotFoundError(
            f"source {repo_id!r} is not a local folder and could not be downloaded from the "
            f"Hugging Face Hub ({type(exc).__name__}: {exc})"
        ) from exc


def inspect_source(src) -> Source:
    """Load and check the source's config and weight files (nothing heavy is read)."""
    from transformers import AutoConfig

    path, name = resolve_source(src)
    raw = read_config(path)  # one-line errors for a missing config.json or one that is no JSON object
    model_type = raw.get("model_type")
    if isinstance(model_type, str) and model_type.startswith(PREFIX) or raw.get("qknorm") is not None:
        raise ValueError(f"{path} is already converted (model_type {model_type!r}); convert the original model")
    archs = raw.get("architectures") or []
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        raise ValueError(
            f"{path} is not a causal language model (architectures {archs}); "
            "hf_qknorm converts *ForCausalLM / *LMHeadModel checkpoints"
        )
    config = AutoConfig.from_pretrained(path)
    family = get_family(config)
    if family.model_type not in SPELLED_OUT_TYPES:
        raise UnsupportedModelError(
            f"convert calibrates and verifies model types {', '.join(SPELLED_OUT_TYPES)}; model type "
            f"{family.model_type!r} is patched by hf_qknorm.patch_model (then save_pretrained writes a folder that "
            "loads with or without the plugin), but not converted"
        )
    weights = read_source_weights(path, family)
    check_matches_config(weights, config)
    return Source(path=path, name=name, config=config, family=family, weights=weights)

"""The source of a conversion: a local folder or a Hub id, its config, family and weight files (nothing heavy read)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ...modeling.derive import get_family
from ...modeling.saved import read_config, unbuildable_reason
from ...portable.families import Family, UnsupportedModelError, reusing_layers, text_config_of
from ...portable.layout import find_layers
from ...portable.names import PREFIX
from ..output.shards import SourceWeights, check_matches_config, read_source_weights, skeleton

__all__ = ["Source", "check_patchable", "inspect_source", "resolve_source"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class Source:
    path: Path
    name: str  # Hub id or folder name, for the model card's base_model
    config: object
    family: Family
    weights: SourceWeights
    # layers with no key projection of their own, attending over an earlier layer's keys and values (Gemma 3n's and
    # Gemma 4's KV-shared tail): fitted after the layer they read, so their heal cannot be split over processes
    reusing: tuple[int, ...] = ()


def resolve_source(src) -> tuple[Path, str]:
    """A local folder, or a Hub id downloaded with ``huggingface_hub`` where the Hub is reachable."""
    if src is None:
        from ...data import bundled_model_dir

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


def inspect_source(src, cfg=None) -> Source:
    """Load and check the source's config and weight files (nothing heavy is read). With the scheme ``cfg``, refuse
    first what patching would refuse (:func:`check_patchable`)."""
    from transformers import AutoConfig

    path, name = resolve_source(src)
    raw = read_config(path)  # one-line errors for a missing config.json or one that is no JSON object
    model_type = raw.get("model_type")
    if isinstance(model_type, str) and model_type.startswith(PREFIX) or raw.get("qknorm") is not None:
        raise ValueError(f"{path} is already converted (model_type {model_type!r}); convert the original model")
    config = AutoConfig.from_pretrained(path)
    unbuildable = unbuildable_reason(config)
    if unbuildable is not None:  # its written folder could not be loaded either (Evolla)
        raise UnsupportedModelError(
            f"model type {raw.get('model_type')!r}: {unbuildable}; patch_model patches the model loaded with its own "
            "class in memory"
        )
    # a multimodal model: its language model is converted, found in the whole model as patching finds it
    multimodal = text_config_of(config) is not config
    archs = raw.get("architectures") or []
    if not multimodal and archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        raise ValueError(
            f"{path} is not a causal language model (architectures {archs}); "
            "hf_qknorm converts *ForCausalLM / *LMHeadModel checkpoints and the language model of multimodal ones"
        )
    family = None if multimodal else get_family(config)
    model = skeleton(config, path)
    if model.get_output_embeddings() is None:  # a classifier over a language model (ShieldGemma 2)
        raise UnsupportedModelError(
            f"model type {raw.get('model_type')!r}: its checkpoint is a {type(model).__name__}, a classifier "
            "without a next-token output head; hf_qknorm converts causal language models and the language model "
            "of image-text-to-text ones (patch_model patches this model in memory)"
        )
    family = family or get_family(model)
    # where the causal LM holds its blocks (a head model whose base-model prefix names no attribute of it)
    blocks = find_layers(model, family)
    reusing = reusing_layers(blocks, family)
    shared = getattr(text_config_of(config), "num_kv_shared_layers", 0)
    if isinstance(shared, int) and shared > 0 and not reusing:
        import transformers

        raise UnsupportedModelError(
            f"model type {raw.get('model_type')!r}: its last {shared} layers reuse earlier layers' keys and values "
            f"(num_kv_shared_layers), which Transformers {transformers.__version__} does only through a cache (each "
            "layer computes its own without one, so the model computes two things); converting it needs a newer "
            "Transformers (5.17 and later share them in every forward)"
        )
    family = dataclasses.replace(family, layers=next(n for n, m in model.named_modules() if m is blocks))
    weights = read_source_weights(path, family, config, model)
    check_matches_config(weights, config)
    if cfg is not None:
        eps = family.norm_eps(config, "; pass --eps") if cfg.eps is None else cfg.eps
        check_patchable(path, dataclasses.replace(cfg, eps=eps), weights)
    return Source(path=path, name=name, config=config, family=family, weights=weights, reusing=reusing)


PROBE_LAYERS = 2  # layers of the source that the patch's self-check runs on before a conversion starts


def check_patchable(path: Path, cfg, weights: SourceWeights | None = None) -> None:
    """Refuse, before any work, a conversion that :func:`hf_qknorm.patch_model` would refuse: the source's first
    :data:`PROBE_LAYERS` layers (of the source folder ``path``) are loaded (float32, its own weights) and patched
    with ``cfg`` (its ``eps`` resolved), so the patch-time
    self-check runs on the source itself (a parallel block under ``qkv_norm``, a transform between the projections
    and the attention backend, ...). Raises :class:`~hf_qknorm.portable.families.UnsupportedModelError` with
    patching's one-line reason. With the source's ``weights``, a NaN or infinite weight in those layers is an error
    naming it first."""
    from ...modeling.patch import patch_model
    from ...verification.loading import quiet_transformers
    from ..output.shards import load_pretrained
    from .checks import layer_view

    with quiet_transformers(), layer_view(path, PROBE_LAYERS) as view:
        model = load_pretrained(view)
    if weights is not None:  # a NaN or inf weight is named as such, not as the refusal a probe of it would give
        for name, prm in model.named_parameters():
            if prm.is_floating_point() and not bool(torch.isfinite(prm).all()) and weights.has(name):
                weights.read_param(name)  # raises naming the tensor and its file
    patch_model(model.eval(), cfg)

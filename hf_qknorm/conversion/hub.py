"""Model cards and Hub uploads for converted folders.

:func:`write_model_card` fills ``conversion/templates/qknorm_model_card.md`` (shipped as package data) through
``huggingface_hub``'s ``ModelCard``/``ModelCardData``: metadata (base_model, the licence inherited from the source's
card, library_name, tags), the scheme, how to load the folder, and the calibration report. :func:`push` creates the
repo and uploads the folder with ``huggingface_hub.HfApi`` (token from the argument, ``HF_TOKEN`` or the cached
``hf auth login``); everything it needs is checked before the first network call.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

TEMPLATE = "qknorm_model_card.md"
REQUIRED_FILES = ("config.json", "README.md")

_SCHEMES = {
    "qk_norm": ("QK-norm", "a per-head norm on every query and key, before RoPE (Henry et al. 2020; Dehghani et al. "
                           "2023; Qwen3)."),
    "soft_cap": ("softmax capping", "attention logits `s` become `c * tanh(s / c)` before the mask and softmax "
                                    "(Gemma 2)."),
    "qk_norm_cap": ("QK-norm + softmax capping", "a per-head norm on every query and key before RoPE, and logits "
                                                 "`s` capped to `c * tanh(s / c)` (Rybakov et al. 2024)."),
    "qkv_norm": ("QKV-norm", "a per-head norm on every query, key and value; the block's pre-attention norm is "
                             "removed and its gain folded into the projections (Rybakov et al. 2024)."),
}


def template_path() -> Path:
    return Path(str(resources.files("hf_qknorm.conversion").joinpath("templates", TEMPLATE)))


def source_licence(source_dir: Path | None) -> dict:
    """``license`` (and ``license_name``/``license_link``) from the source's model card metadata, if any."""
    from huggingface_hub import ModelCard

    readme = None if source_dir is None else Path(source_dir) / "README.md"
    if readme is None or not readme.is_file():
        return {}
    try:
        data = ModelCard.load(readme, ignore_metadata_errors=True).data.to_dict()
    except Exception:  # a README without (valid) metadata: nothing to inherit
        return {}
    return {k: data[k] for k in ("license", "license_name", "license_link") if data.get(k)}


def _load_snippet(export: str, name: str) -> tuple[str, str]:
    if export == "qwen3":
        return (f'from transformers import AutoModelForCausalLM, AutoTokenizer\n\n'
                f'model = AutoModelForCausalLM.from_pretrained("{name}")  # a plain Qwen3ForCausalLM\n'
                f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
                "This is exactly a Qwen3 model (per-head RMSNorm on queries and keys before RoPE), so plain "
                "Transformers loads it with no plugin and no remote code.")
    return (f'from transformers import AutoModelForCausalLM, AutoTokenizer\n\n'
            f'# without hf_qknorm: the modelling code shipped in this folder\n'
            f'model = AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)\n\n'
            f'# with hf_qknorm (pip install hf-qknorm): fused kernels and a memory-lean capped attention\n'
            f'import hf_qknorm\n'
            f'model = AutoModelForCausalLM.from_pretrained("{name}")\n'
            f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
            "`model_type` is `qknorm_<base>`: Transformers alone refuses the folder rather than loading it as the "
            "base model without its norms. `modeling_qknorm.py` and `configuration_qknorm.py` here rebuild it "
            "with `trust_remote_code=True`; `import hf_qknorm` registers the same model type natively.")


def build_model_card(*, base_model: str | None, cfg, export: str, report=None, dtype: str = "float32",
                     model_name: str = "converted model", source_dir: Path | None = None,
                     export_note: str | None = None, versions: dict | None = None):
    """The filled :class:`huggingface_hub.ModelCard` of a converted folder."""
    from huggingface_hub import ModelCard, ModelCardData

    from ..upstream import installed_versions

    scheme = cfg.to_dict()
    hub_base = base_model if base_model and "/" in base_model and " " not in base_model \
        and not Path(base_model).exists() else None
    tags = ["hf-qknorm", scheme["scheme"].replace("_", "-")]
    tags += [f"{scheme['norm']}-qk-norm"] if cfg.norms_qk else []
    tags += ["softcap"] if cfg.caps else []
    tags += ["qwen3"] if export == "qwen3" else ["custom_code"]
    licence = source_licence(source_dir)
    data = ModelCardData(base_model=hub_base, library_name="transformers", pipeline_tag="text-generation",
                         tags=tags, **licence)
    title, description = _SCHEMES[scheme["scheme"]]
    snippet, note = _load_snippet(export, model_name)
    fmt = ("plain `qwen3` (no plugin needed)" if export == "qwen3"
           else "`qknorm_<base>` with `trust_remote_code` modelling code")
    if export_note and export != "qwen3":
        fmt += f" (not `qwen3`: {export_note})"
    return ModelCard.from_template(
        data, template_path=str(template_path()), model_name=model_name,
        base_model_sentence=f"`{base_model}`" if base_model else "A pretrained model",
        scheme=scheme, scheme_title=title, scheme_description=description, format_description=fmt,
        dtype=dtype, load_snippet=snippet, load_note=note, report=report,
        perplexity_table=report.perplexity_table() if report else "",
        layer_table=report.layer_table() if report else "",
        recovered=f"{100 * report.recovered:.1f}%" if report else "",
        versions=versions or installed_versions(),
        licence_note=(f"Licence: `{licence['license']}`, inherited from the source model." if licence
                      else "The source model's card gave no licence; check its terms before sharing."))


def write_model_card(folder: Path, *, model_name: str, source_dir, base_model, cfg, export, report,
                     export_note=None) -> Path:
    """Write ``README.md`` (the model card) into ``folder``."""
    import json

    folder = Path(folder)
    dtype = json.loads((folder / "config.json").read_text()).get("dtype", "float32")
    card = build_model_card(base_model=base_model, cfg=cfg, export=export, report=report, dtype=str(dtype),
                            model_name=model_name, source_dir=source_dir,
                            export_note=export_note)
    card.save(folder / "README.md")
    return folder / "README.md"


# --------------------------------------------------------------------------------------------------------------------
# push
# --------------------------------------------------------------------------------------------------------------------
def resolve_token(token: str | None = None) -> str:
    """The token to upload with: ``token``, else ``HF_TOKEN``, else the cached ``hf auth login`` token."""
    from huggingface_hub import get_token

    token = token or get_token()
    if not token:
        raise ValueError("no Hugging Face token found: pass --token (token=...), set HF_TOKEN, or run "
                         "`hf auth login` first; nothing was uploaded")
    return token


def upload_files(folder: Path) -> list[str]:
    """The files :func:`push` uploads (every file of the folder except hidden ones), relative to it."""
    folder = Path(folder)
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def card_metadata(folder: Path) -> dict:
    """The metadata block of ``folder/README.md`` (what the Hub indexes)."""
    from huggingface_hub import ModelCard

    return ModelCard.load(Path(folder) / "README.md").data.to_dict()


def check_folder(folder: Path) -> None:
    """Refuse to upload a folder that is not a converted model (config, card, weights)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"folder to push not found: {folder}")
    missing = [f for f in REQUIRED_FILES if not (folder / f).is_file()]
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ValueError(f"{folder} is not a converted model folder (missing {', '.join(missing)}); "
                         "create it with `hf-qknorm convert`")


def push(folder, repo_id: str, *, private: bool | None = None, revision: str | None = None,
         commit_message: str | None = None, token: str | None = None, api=None) -> str:
    """Create ``repo_id`` (if needed) and upload ``folder`` to it; returns the commit URL.

    ``revision`` names a branch, created if missing. ``api`` is an ``HfApi``-like object (tests pass a mock)."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    check_folder(folder)
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise ValueError(f"invalid Hub repo id {repo_id!r}: {exc}") from None
    token = resolve_token(token)
    api = api if api is not None else HfApi()
    api.create_repo(repo_id, token=token, private=private, repo_type="model", exist_ok=True)
    if revision:
        api.create_branch(repo_id, branch=revision, token=token, repo_type="model", exist_ok=True)
    info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model", revision=revision,
                             commit_message=commit_message or f"Upload {Path(folder).name} (hf_qknorm convert)",
                             token=token, ignore_patterns=[".*", "**/.*"])
    return str(getattr(info, "commit_url", info))

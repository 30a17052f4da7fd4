"""Model cards and Hub uploads for converted folders.

:func:`write_model_card` fills ``conversion/output/templates/qknorm_model_card.md`` (shipped as package data) through
``huggingface_hub``'s ``ModelCard``/``ModelCardData``: metadata (base_model, the licence inherited from the source's
card, library_name, tags), the scheme, how to load the folder, and the calibration report. :func:`push` creates the
repo and uploads the folder with ``huggingface_hub.HfApi`` (token from the argument, ``HF_TOKEN`` or the cached
``hf auth login``); everything it needs is checked before the first network call.

Names and strings that come from outside -- the source folder's name or Hub id, the destination's name, the
source card's licence fields -- are never trusted: in Markdown they are escaped (:func:`md_text`: HTML entities,
backslash-escaped Markdown punctuation, control characters shown as ``\\uXXXX``), in the Python load snippet they are
Python literals (``repr``), and in the YAML metadata only values that look like Hub licence ids and links are kept
(``yaml.dump`` quotes them).
"""

from __future__ import annotations

import html
import json
import logging
import re
import unicodedata
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

logger = logging.getLogger(__name__)

TEMPLATE = "qknorm_model_card.md"
IMAGE_TEXT = "AutoModelForImageTextToText"  # the Auto class of a multimodal model, unless it has another
# A multimodal model's Auto class -> its card's pipeline tag (an audio model's, AutoModelForMultimodalLM: none said)
PIPELINES = {IMAGE_TEXT: "image-text-to-text"}
REQUIRED_FILES = ("config.json", "README.md")

_SCHEMES = {
    "qk_norm": (
        "QK-norm",
        "a per-head norm on every query and key, before RoPE (Henry et al. 2020; Dehghani et al. 2023; Qwen3).",
    ),
    "soft_cap": (
        "softmax capping",
        "attention logits `s` become `c * tanh(s / c)` before the mask and softmax (Gemma 2).",
    ),
    "qk_norm_cap": (
        "QK-norm + softmax capping",
        "a per-head norm on every query and key before RoPE, and logits "
        "`s` capped to `c * tanh(s / c)` (Rybakov et al. 2024).",
    ),
    "qkv_norm": (
        "QKV-norm",
        "a per-head norm on every query, key and value; the block's pre-attention norm is "
        "removed and its gain folded into the projections (Rybakov et al. 2024).",
    ),
}


_MD_PUNCT = re.compile(r"([\\`*_{}\[\]()!|~])")
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][\w./ ()-]*")
_LICENCE_ID = re.compile(r"[a-z0-9][a-z0-9.+-]{0,63}")
_LICENCE_LINK = re.compile(r"https?://[^\s<>\"'`\\]{1,500}|[A-Za-z0-9._/-]{1,200}")  # a URL or a file here


@dataclass(frozen=True)
class HubSettings:
    """Where and how :func:`hf_qknorm.convert` uploads the folder it wrote (``repo_id`` ``None``: nowhere). The repo
    id and the token are checked before any conversion work; the upload is :func:`push`."""

    # metadata["help"] (and "flag"): the command line's flags are made from these fields
    repo_id: str | None = field(
        default=None,
        metadata={
            "help": "upload the folder to this Hub repo once written (created if missing)",
            "flag": "push-to-hub",
            "metavar": "REPO_ID",
        },
    )
    private: bool | None = field(default=None, metadata={"help": "create the repo as private"})
    revision: str | None = field(
        default=None, metadata={"help": "branch to upload to (created if missing; default main)"}
    )
    commit_message: str | None = field(default=None, metadata={"help": "commit message of the upload"})
    token: str | None = field(
        default=None,
        metadata={"help": "Hub token (default: the HF_TOKEN environment variable, else the `hf auth login` cache)"},
    )

    def __post_init__(self):
        if self.repo_id is not None:
            check_repo_id(self.repo_id)
        if self.private is not None and not isinstance(self.private, bool):
            raise ValueError(f"private must be True, False or None, got {self.private!r}")


def md_text(value) -> str:
    """``value`` as Markdown text that renders literally: control and format characters (newlines, bidi overrides)
    shown as ``\\uXXXX``, Markdown punctuation backslash-escaped, then ``& < >`` as HTML entities (with no ``<``
    no tag, and so no attribute, can open: quotes need no escaping)."""
    text = "".join(f"\\u{ord(c):04x}" if unicodedata.category(c)[0] == "C" else c for c in str(value))
    return html.escape(_MD_PUNCT.sub(r"\\\1", text), quote=False)


def md_name(value) -> str:
    """A name in Markdown: as inline code when it is a plain name (letters, digits, ``_ . / - ( )`` and spaces),
    else escaped text (a backtick could end a code span)."""
    text = str(value)
    return f"`{text}`" if _PLAIN_NAME.fullmatch(text) else md_text(text)


def py_str(value) -> str:
    """``value`` as a Python string literal (``repr``, so quotes, newlines and code in it stay inside the string),
    in double quotes when it holds no quote character."""
    lit = repr(str(value))
    return f'"{lit[1:-1]}"' if lit.startswith("'") and '"' not in lit else lit


def check_repo_id(repo_id) -> str:
    """``repo_id`` if ``huggingface_hub`` accepts it as a model repo id, else a ``ValueError`` naming it."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise ValueError(
            f"invalid Hub repo id {repo_id!r}: {exc} Use <user or organisation>/<name>, e.g. me/llama-qknorm"
        ) from None
    if not repo_id:
        raise ValueError("invalid Hub repo id '': give <user or organisation>/<name>, e.g. me/llama-qknorm")
    return repo_id


def template_path() -> Path:
    return Path(str(resources.files("hf_qknorm.conversion.output").joinpath("templates", TEMPLATE)))


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
    rules = {"license": _LICENCE_ID, "license_name": _LICENCE_ID, "license_link": _LICENCE_LINK}
    kept = {k: data[k] for k, rule in rules.items() if isinstance(data.get(k), str) and rule.fullmatch(data[k])}
    if any(data.get(k) and k not in kept for k in rules):  # not an id or link: not carried into the metadata
        kept["unusable"] = True
    return kept


def _load_snippet(
    export: str,
    name: str,
    tokenizer: bool = True,
    model_type: str | None = None,
    text_type: str | None = None,
    load_with: str = IMAGE_TEXT,
) -> tuple[str, str]:
    snippet, note = _model_snippet(export, name, model_type, text_type, load_with)
    if tokenizer:
        return snippet, note
    snippet = snippet.replace(", AutoTokenizer", "").replace(
        f"\ntokenizer = AutoTokenizer.from_pretrained({py_str(name)})", ""
    )
    return snippet, note + (
        " This folder has no tokenizer: the checkpoint it was converted from had none; use the "
        "tokenizer the model was trained with."
    )


def _model_snippet(
    export: str, name: str, model_type: str | None = None, text_type: str | None = None, load_with: str = IMAGE_TEXT
) -> tuple[str, str]:
    """The loading code and its note; ``text_type``: a multimodal model's language model type (``None``: a text
    model), which loads through ``load_with`` (``AutoModelForImageTextToText``; an audio model's
    ``AutoModelForMultimodalLM``)."""
    snippet, note = _text_model_snippet(export, py_str(name), model_type)
    if text_type is None:
        return snippet, note
    snippet = snippet.replace("AutoModelForCausalLM", load_with)
    if export == "qwen3":
        snippet = snippet.replace("a plain Qwen3ForCausalLM", f"a plain {model_type} model, its language model Qwen3")
        note = (
            f"Its language model is exactly a Qwen3 model (per-head RMSNorm on queries and keys before RoPE) and "
            f"`{model_type}` takes a language model of any type, so plain Transformers loads it with no plugin and "
            "no remote code; the vision tower and projector are the source's, unchanged."
        )
    else:
        note += " Only the language model changed: the vision tower and projector are the source's, unchanged."
    return snippet, note


def _text_model_snippet(export: str, name: str, model_type: str | None) -> tuple[str, str]:
    if export == "native":
        return (
            f"from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f"model = AutoModelForCausalLM.from_pretrained({name})  # a plain {model_type} model\n"
            f"tokenizer = AutoTokenizer.from_pretrained({name})",
            f"The model's own per-head query and key norms are this scheme's norms, so the converted model is still "
            f"a `{model_type}` model (only their gains changed): plain Transformers loads it with no plugin and no "
            "remote code.",
        )
    if export == "qwen3":
        return (
            f"from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f"model = AutoModelForCausalLM.from_pretrained({name})  # a plain Qwen3ForCausalLM\n"
            f"tokenizer = AutoTokenizer.from_pretrained({name})",
            "This is exactly a Qwen3 model (per-head RMSNorm on queries and keys before RoPE), so plain "
            "Transformers loads it with no plugin and no remote code.",
        )
    return (
        f"from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        f"# without hf_qknorm: the modelling code shipped in this folder\n"
        f"model = AutoModelForCausalLM.from_pretrained({name}, trust_remote_code=True)\n\n"
        f"# with hf_qknorm installed: fused kernels and a memory-lean capped attention\n"
        f"import hf_qknorm\n"
        f"model = AutoModelForCausalLM.from_pretrained({name})\n"
        f"tokenizer = AutoTokenizer.from_pretrained({name})",
        "`model_type` is `qknorm_<base>`: Transformers alone refuses the folder rather than loading it as the "
        "base model without its norms. `modeling_qknorm.py` and `configuration_qknorm.py` here rebuild it "
        "with `trust_remote_code=True`; `import hf_qknorm` registers the same model type natively.",
    )


def build_model_card(
    *,
    base_model: str | None,
    cfg,
    export: str,
    report=None,
    dtype: str = "float32",
    model_name: str = "converted model",
    source_dir: Path | None = None,
    export_note: str | None = None,
    versions: dict | None = None,
    model_type: str | None = None,
    text_type: str | None = None,
    load_with: str = IMAGE_TEXT,
):
    """The filled :class:`huggingface_hub.ModelCard` of a converted folder (``model_type``: the type a plain export
    is written as; ``text_type``: a multimodal model's language model type, ``None`` for a text model; ``load_with``:
    the Auto class a multimodal one loads with)."""
    from huggingface_hub import ModelCard, ModelCardData

    from ...upstream import installed_versions

    scheme = cfg.to_dict()
    hub_base = base_model if base_model and _is_repo_id(base_model) and not Path(base_model).exists() else None
    tags = ["hf-qknorm", scheme["scheme"].replace("_", "-")]
    tags += [f"{scheme['norm']}-qk-norm"] if cfg.norms_qk else []
    tags += ["softcap"] if cfg.caps else []
    tags += ["qwen3"] if export == "qwen3" else [str(model_type)] if export == "native" else ["custom_code"]
    licence = source_licence(source_dir)
    unusable = licence.pop("unusable", False)
    data = ModelCardData(
        base_model=hub_base,
        library_name="transformers",
        pipeline_tag="text-generation" if text_type is None else PIPELINES.get(load_with),
        tags=tags,
        **licence,
    )
    title, description = _SCHEMES[scheme["scheme"]]
    from .export import has_tokenizer

    tokenizer = source_dir is None or has_tokenizer(source_dir)
    snippet, note = _load_snippet(export, model_name, tokenizer, model_type, text_type, load_with)
    qwen3 = "plain `qwen3`" if text_type is None else f"plain `{model_type}` with a `qwen3` language model"
    fmt = {
        "qwen3": f"{qwen3} (no plugin needed)",
        "native": f"plain `{model_type}`, the source's own model type (no plugin needed)",
    }.get(export, "`qknorm_<base>` with `trust_remote_code` modelling code")
    if export_note and export == "qknorm":
        fmt += f" (not a plain model type: {md_text(export_note)})"
    return ModelCard.from_template(
        data,
        template_path=str(template_path()),
        model_name=md_text(model_name),
        base_model_sentence=md_name(base_model) if base_model else "A pretrained model",
        scheme=scheme,
        scheme_title=title,
        scheme_description=description,
        format_description=fmt,
        dtype=dtype,
        load_snippet=snippet,
        load_note=note,
        report=report,
        perplexity_table=report.perplexity_table() if report else "",
        layer_table=report.layer_table() if report else "",
        recovery=_capitalised(report.recovery(bold=True)) if report else "",
        versions=versions or installed_versions(),
        licence_note=_licence_note(licence, unusable),
    )


def _capitalised(sentence: str) -> str:
    return sentence[:1].upper() + sentence[1:]


def _licence_note(licence: dict, unusable: bool) -> str:
    if licence.get("license"):
        return f"Licence: {md_name(licence['license'])}, inherited from the source model."
    if unusable:
        return (
            "The source model's card names a licence that is not a Hub licence id, so it was not carried "
            "over; check the source's terms before sharing."
        )
    return "The source model's card gave no licence; check its terms before sharing."


def _is_repo_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return "/" in name


def write_model_card(
    folder: Path,
    *,
    model_name: str,
    source_dir,
    base_model,
    cfg,
    export,
    report,
    export_note=None,
    load_with=IMAGE_TEXT,
) -> Path:
    """Write ``README.md`` (the model card) into ``folder`` (``load_with``: a multimodal model's Auto class)."""
    import json

    folder = Path(folder)
    saved = json.loads((folder / "config.json").read_text())
    dtype = saved.get("dtype", "float32")
    text = saved.get("text_config")  # a multimodal model's language model
    card = build_model_card(
        model_type=saved.get("model_type"),
        text_type=text.get("model_type") if isinstance(text, dict) else None,
        base_model=base_model,
        cfg=cfg,
        export=export,
        report=report,
        dtype=str(dtype),
        model_name=model_name,
        source_dir=source_dir,
        export_note=export_note,
        load_with=load_with,
    )
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
        raise ValueError(
            "no Hugging Face token found: pass --token (token=...), set HF_TOKEN, or run "
            "`hf auth login` first; nothing was uploaded"
        )
    return token


def upload_files(folder: Path) -> list[str]:
    """The files :func:`push` uploads (every file of the folder except hidden ones), relative to it."""
    folder = Path(folder)
    return sorted(
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


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
        raise ValueError(
            f"{folder} is not a converted model folder (missing {', '.join(missing)}); "
            "create it with `hf-qknorm convert`"
        )


def card_for_repo(folder: Path, repo_id: str) -> str | None:
    """The model card of ``folder`` as it should read on the Hub at ``repo_id``: its load snippet and title name
    ``repo_id`` instead of the name the card was written with (``card_model_name`` in ``qknorm_conversion.json``,
    else the folder's name). ``None`` when nothing needs to change. The folder itself is not modified."""
    folder = Path(folder)
    readme = (folder / "README.md").read_text(encoding="utf-8")
    old = folder.name
    report = folder / "qknorm_conversion.json"
    if report.is_file():
        try:
            old = json.loads(report.read_text()).get("card_model_name") or old
        except (ValueError, AttributeError):
            pass
    if old == repo_id:
        return None
    snippet_old, snippet_new = f"from_pretrained({py_str(old)}", f"from_pretrained({py_str(repo_id)}"
    if snippet_old not in readme:
        logger.warning("%s/README.md has no load snippet naming %r (edited?); it is uploaded as it is", folder, old)
        return None
    text = readme.replace(snippet_old, snippet_new)
    return text.replace(f"\n# {md_text(old)}\n", f"\n# {md_text(repo_id)}\n", 1)


def push(
    folder,
    repo_id: str,
    *,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
    api=None,
) -> str:
    """Create ``repo_id`` (if needed) and upload ``folder`` to it in one commit; returns the commit URL.

    The uploaded model card names ``repo_id`` in its load snippet and title (:func:`card_for_repo`); the local
    ``README.md`` is left as it is. ``revision`` names a branch, created if missing. ``api`` is an ``HfApi``-like
    object (tests pass a mock). A Hub that cannot be reached, or that refuses the upload, is an ``OSError`` that
    says which repo and why."""
    from huggingface_hub import CommitOperationAdd, HfApi

    folder = Path(folder)
    check_repo_id(repo_id)
    check_folder(folder)
    token = resolve_token(token)
    card = card_for_repo(folder, repo_id)
    operations = [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(folder / name))
        for name in upload_files(folder)
        if not (card is not None and name == "README.md")
    ]
    if card is not None:
        operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode("utf-8")))
    api = api if api is not None else HfApi()
    try:
        api.create_repo(repo_id, token=token, private=private, repo_type="model", exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, token=token, repo_type="model", exist_ok=True)
        info = api.create_commit(
            repo_id,
            operations=operations,
            repo_type="model",
            revision=revision,
            commit_message=commit_message or f"Upload {folder.name} (hf_qknorm convert)",
            token=token,
        )
    except Exception as exc:  # unreachable, refused, rate-limited...: one line naming the repo and the cause
        first = (str(exc).strip().splitlines() or [""])[0]
        raise OSError(
            f"could not upload {folder} to the Hugging Face Hub repo {repo_id!r}: {type(exc).__name__}: {first}"
        ) from exc
    return str(getattr(info, "commit_url", info))

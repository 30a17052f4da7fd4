"""Checkpoint conversion: ``hf_qknorm.convert`` and ``hf-qknorm convert``.

Takes a pretrained checkpoint, adds the scheme's norm weights initialised by calibration
(:mod:`hf_qknorm.conversion.calibrate`), and writes a folder that loads anywhere (:mod:`hf_qknorm.conversion.export`)
with a model card
(:mod:`hf_qknorm.conversion.hub`). Safe by construction:

- the source is only read, never written;
- every safetensors header is checked before any work starts, so a corrupt or truncated file is a clear error;
- the output is written into a temporary folder beside the destination and renamed into place when complete and
  checked (:mod:`hf_qknorm.conversion.checks`: a finite report, the added tensors as computed, the verifier on the
  written folder); on any error, SIGINT or SIGTERM the temporary folder is removed, so nothing is left half-written,
  and one left by a killed run is removed by the next (:mod:`hf_qknorm.conversion.tempdirs`); an existing
  destination is refused unless ``overwrite=True``;
- weights are written shard by shard from the source files (read one shard, add or transform its tensors, write
  it, update the index), so writing needs about one shard of memory. Calibration streams the checkpoint one decoder
  block at a time (:mod:`hf_qknorm.conversion.layerwise`); only the optional KL polish loads the whole model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..modeling.saved import read_config
from ..portable.families import Family, get_family
from ..portable.names import PREFIX
from ..portable.norms import initial_value
from ..portable.schemes import QKNormConfig
from ..upstream import installed_versions
from .calibrate import CalibrationReport, CalibrationSettings, new_norm_parameters
from .checks import VERIFY_MODES, check_report_finite, check_request, check_written, verify_output
from .hub import HubSettings
from .shards import SourceWeights, WeightPlan, check_matches_config, plan_weights, read_source_weights, write_weights
from .tempdirs import check_writable, staging

__all__ = ["ConversionResult", "convert", "default_destination"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
REPORT_FILE = "qknorm_conversion.json"


@dataclass
class ConversionResult:
    """What :func:`convert` wrote: the folder, its format (``"qwen3"`` or ``"qknorm"``, with the reason a
    ``qwen3`` export was not possible), the scheme, the calibration report and the files."""

    path: Path
    export: str
    export_note: str | None
    scheme: QKNormConfig
    report: CalibrationReport | None
    files: list[str] = field(default_factory=list)
    pushed_url: str | None = None


# --------------------------------------------------------------------------------------------------------------------
# the source
# --------------------------------------------------------------------------------------------------------------------
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
    family = get_family(model_type)
    archs = raw.get("architectures") or []
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        raise ValueError(
            f"{path} is not a causal language model (architectures {archs}); "
            "hf_qknorm converts *ForCausalLM / *LMHeadModel checkpoints"
        )
    config = AutoConfig.from_pretrained(path)
    weights = read_source_weights(path, family)
    check_matches_config(weights, config)
    return Source(path=path, name=name, config=config, family=family, weights=weights)


# --------------------------------------------------------------------------------------------------------------------
# texts
# --------------------------------------------------------------------------------------------------------------------
_TEXT_SUFFIXES = (".txt", ".md", ".raw", ".text")


def load_text(value, what: str) -> str | None:
    """``value`` is a path, a bundled text name (``"tinyshakespeare"``, ``"wikitext2"``) or the text itself."""
    from ..data import read_text

    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{what} must be a str or a path, got {type(value).__name__}")
    if _names_a_file(value):
        try:
            return read_text(value)
        except (OSError, ValueError) as exc:  # say which of the texts it was
            raise type(exc)(f"{what}: {exc}") from None
    if not value.strip():
        raise ValueError(f"{what} is empty; give text (or a file of text) to run through the model")
    return value


def _names_a_file(value) -> bool:
    """Whether :func:`load_text` reads ``value`` as a file (or bundled text) name rather than as the text itself."""
    from ..data import BUNDLED_TEXTS

    return (
        isinstance(value, os.PathLike)
        or "\n" not in value
        and len(value) < 4096
        and (value in BUNDLED_TEXTS or os.path.exists(value) or value.lower().endswith(_TEXT_SUFFIXES))
    )


def _text_label(value, what: str) -> str:
    """How errors name a text the user gave: the file (or bundled) name, or the string given as text."""
    if _names_a_file(value):
        return f"{what} {str(value)!r}"
    if "\n" in value or len(value) >= 4096:
        return f"{what} (the {len(value):,}-character string given)"
    return f"{what} {value!r} (read as the text itself: no file of that name exists)"


def _blocks(text: str, tokenizer, block_len: int, max_blocks: int, what: str) -> torch.Tensor:
    """Up to ``max_blocks`` blocks of ``block_len`` tokens spread evenly over ``text``, each led by BOS when the
    tokenizer has one (the layout of :func:`hf_qknorm.data.tokenize_blocks`, which held-out perplexities in
    ``TRAINING.md`` use)."""
    from ..data import tokenize_stream

    bos = getattr(tokenizer, "bos_token_id", None)
    n_text = block_len - int(bos is not None)
    stream = tokenize_stream(text, tokenizer)  # tokenised once: a whole corpus can take seconds
    if len(stream) < n_text:
        raise ValueError(
            f"{what} is too short: {len(stream):,} tokens, and one block of {block_len} tokens "
            f"({n_text} of text{' + BOS' if bos is not None else ''}) is needed; give more text or a "
            "smaller block length (--block-len)"
        )
    n_blocks = min(max_blocks, len(stream) // n_text)
    spread = n_blocks < len(stream) // n_text and n_blocks > 1  # else back to back, as tokenize_blocks does
    stride = max(n_text, (len(stream) - n_text) // (n_blocks - 1)) if spread else n_text
    blocks = stream.unfold(0, n_text, stride)[:n_blocks]
    if bos is not None:
        blocks = torch.cat([torch.full((len(blocks), 1), bos, dtype=torch.long), blocks], dim=1)
    return blocks.contiguous()


# --------------------------------------------------------------------------------------------------------------------
# destination and atomic writes
# --------------------------------------------------------------------------------------------------------------------
def default_destination(source_name: str, cfg: QKNormConfig) -> Path:
    """``converted/<source>-<scheme>[-<norm>]`` under the current folder."""
    stem = source_name.split(" ")[0].rstrip("/").split("/")[-1]
    suffix = cfg.scheme + (f"-{cfg.norm}" if cfg.norms_qk else "")
    return Path("converted") / f"{stem}-{suffix}"


def _check_destination(dst: Path, src: Path, overwrite: bool) -> Path:
    dst = Path(dst).expanduser().resolve()
    if dst == src or src in dst.parents or dst in src.parents:
        raise ValueError(f"destination {dst} overlaps the source {src}; the source is never modified")
    if dst.exists() and not overwrite:
        raise FileExistsError(f"destination {dst} already exists; pass overwrite=True (--overwrite) to replace it")
    if dst.exists() and not dst.is_dir():
        raise FileExistsError(f"destination {dst} exists and is not a folder")
    return dst


# --------------------------------------------------------------------------------------------------------------------
# conversion
# --------------------------------------------------------------------------------------------------------------------
def convert(
    src=None,
    dst=None,
    config: QKNormConfig | str | None = None,
    calibration: CalibrationSettings | None = None,
    hub: HubSettings | None = None,
    *,
    calibrate: bool = True,
    calibration_text=None,
    eval_text=None,
    export: str = "auto",
    overwrite: bool = False,
    verify: str = "full",
    progress: bool = True,
    log=print,
) -> ConversionResult:
    """Convert a pretrained checkpoint to the scheme of ``config`` and write it to ``dst``.

    Args:
        src: a local model folder or a Hub id; ``None`` converts the bundled tiny Llama.
        dst: output folder; ``None`` means ``converted/<source>-<scheme>-<norm>``. An existing folder is refused
            unless ``overwrite``.
        config: the scheme, a :class:`~hf_qknorm.QKNormConfig` (or a scheme name for its defaults); ``None`` is
            ``QKNormConfig()`` (``qk_norm_cap`` + layernorm). Its ``eps`` ``None`` means the model's own.
        calibration: block length, number of blocks, fit and distillation steps, device
            (:class:`~hf_qknorm.CalibrationSettings`); ``None`` for the defaults.
        hub: where to upload the folder once written (:class:`~hf_qknorm.conversion.hub.HubSettings`); ``None``
            or a ``repo_id`` of ``None`` uploads nothing. The repo id and the token are checked before any work.
        calibrate: ``False`` keeps identity init and never loads the model (no report).
        calibration_text: text run through the original model to initialise the new norms: a path, a bundled text
            name or the text itself; ``None`` means the bundled Tiny Shakespeare.
        eval_text: held-out text for the perplexity report; ``None`` holds out the last 10% of
            ``calibration_text`` (which calibration then never sees).
        export: ``"auto"`` (plain ``qwen3`` when the result is a Qwen3 model, else ``qknorm_<base>`` with remote
            code), ``"qwen3"`` (an error when impossible) or ``"qknorm"``.
        verify: how the written folder is verified before it is renamed into place
            (:func:`hf_qknorm.conversion.checks.verify_output`): ``"full"`` (with the plugin, and a ``qknorm_<base>``
            folder also through its remote code in a process without the plugin), ``"plugin"`` or ``"off"``. The
            added tensors are always checked, and a report that is not finite always fails.

    Raises ``ValueError``/``OSError`` for bad input or a failed write, and
    :class:`~hf_qknorm.conversion.checks.ConversionCheckError` when the result fails a check; in every case nothing
    is left at ``dst`` (or an existing ``dst`` is unchanged).
    """
    from .export import check_tokenizer_fits, has_tokenizer, resolve_export

    cfg, settings, hub = settings_objects(config, calibration, hub)
    if verify not in VERIFY_MODES:
        raise ValueError(f"unknown verify mode {verify!r}; choose one of {', '.join(VERIFY_MODES)}")
    token = check_request(settings, hub.repo_id, hub.token)  # a bad repo id or no token: fail now, not after hours
    source = inspect_source(src)
    config, family = source.config, source.family
    if cfg.eps is None:
        cfg = dataclasses.replace(cfg, eps=family.norm_eps(config, "; pass --eps"))
    dst = _check_destination(dst if dst is not None else default_destination(source.name, cfg), source.path, overwrite)
    check_writable(dst)
    kind, note = resolve_export(export, config, cfg, family)
    texts = _texts(calibration_text, eval_text) if calibrate else None
    if has_tokenizer(source.path):
        check_tokenizer_fits(source.path, source.config)
    elif not calibrate:  # calibration would have needed it (a clear error there)
        log(
            f"WARNING: {source.path} has no tokenizer files (tokenizer.json, tokenizer.model, vocab/merges): the "
            "converted folder will have none either; add the tokenizer the model was trained with before using or "
            "publishing it"
        )

    log(
        f"converting {source.name} ({family.model_type}, {source.weights.dtype}, "
        f"{len(source.weights.files)} weight file(s)) to {cfg.scheme}"
        f"{'' if not cfg.norms_qk else ' / ' + cfg.norm} -> {dst} as {kind}"
    )
    if calibrate:
        patched_config, new_values, report = _calibrated(source, cfg, texts, settings, progress)
    else:
        patched_config, new_values, report = *_identity(source, cfg), None
    if report is not None:
        check_report_finite(report)
    result = ConversionResult(path=dst, export=kind, export_note=note, scheme=cfg, report=report)
    with staging(dst, overwrite, log) as tmp:
        plan = _write_folder(
            tmp,
            source,
            cfg,
            kind,
            patched_config,
            new_values,
            result,
            progress,
            model_name=hub.repo_id or dst.name,
            settings=settings,
        )
        check_written(tmp, plan)
        verify_output(tmp, cfg, kind, verify, log)
    result.files = sorted(str(f.relative_to(dst)) for f in dst.rglob("*") if f.is_file())
    if report is not None:
        log(report.summary())
    if note and kind == "qknorm" and export == "auto" and family.model_type in ("llama", "mistral"):
        log(f"note: written as {PREFIX}{family.model_type} (trust_remote_code) rather than qwen3: {note}")
    log(f"wrote {dst} ({kind}): {', '.join(result.files)}")
    if hub.repo_id:
        from .hub import push

        try:
            result.pushed_url = push(
                dst,
                hub.repo_id,
                private=hub.private,
                revision=hub.revision,
                commit_message=hub.commit_message,
                token=token,
            )
        except OSError as exc:
            raise OSError(
                f"{exc}; the converted model is complete in {dst}: upload it later with "
                f"`hf-qknorm push {dst} {hub.repo_id}`"
            ) from exc
        log(f"pushed to {result.pushed_url}")
    return result


def settings_objects(config, calibration, hub):
    """``(QKNormConfig, CalibrationSettings, HubSettings)`` from :func:`convert`'s arguments (``None`` for the
    defaults, a scheme name for its :class:`QKNormConfig`); a ``TypeError`` for a wrong type."""
    config = QKNormConfig(scheme=config) if isinstance(config, str) else config or QKNormConfig()
    calibration = calibration if calibration is not None else CalibrationSettings()
    hub = hub if hub is not None else HubSettings()
    for value, cls, name in (
        (config, QKNormConfig, "config"),
        (calibration, CalibrationSettings, "calibration"),
        (hub, HubSettings, "hub"),
    ):
        if not isinstance(value, cls):
            raise TypeError(f"convert(): {name} must be a {cls.__name__}, got {type(value).__name__}")
    return config, calibration, hub


def _texts(calibration_text, eval_text) -> tuple[str, str, str, str]:
    """``(calibration text, held-out text, and how errors name each)``."""
    from ..data import split_text

    value = calibration_text if calibration_text is not None else "tinyshakespeare"
    calib = load_text(value, "calibration text")
    if not calib.strip():
        raise ValueError("calibration text is empty; give text (or a file of text) to run through the model")
    held = load_text(eval_text, "eval text")
    labels = [_text_label(value, "calibration text")]
    if held is None:
        calib, held = split_text(calib, 0.1)
        labels.append(f"the held-out last 10% of the {labels[0]} (no eval text was given)")
    else:
        labels.append(_text_label(eval_text, "eval text"))
    return calib, held, *labels


def _calibrated(source: Source, cfg, texts, settings: CalibrationSettings, progress: bool):
    """Layer-by-layer calibration streamed from the source files (:mod:`hf_qknorm.conversion.layerwise`), then the
    optional end-to-end KL polish (``settings.steps > 0``), which loads the whole model."""
    import math

    from transformers import AutoTokenizer

    from .calibrate import calibration_threads, polish
    from .layerwise import calibrate_checkpoint
    from .streaming import StreamedCheckpoint

    try:
        tokenizer = AutoTokenizer.from_pretrained(source.path)
    except Exception as exc:
        raise ValueError(
            f"calibration needs the source's tokenizer, which could not be loaded from "
            f"{source.path} ({type(exc).__name__}: {exc}); add it, or pass calibrate=False "
            "(--no-calibration)"
        ) from exc
    block_len = min(settings.block_len, source.family.training_length(source.config))
    calib_blocks = _blocks(texts[0], tokenizer, block_len, settings.calibration_blocks, texts[2])
    eval_blocks = _blocks(texts[1], tokenizer, block_len, settings.eval_blocks, texts[3])
    device = settings.resolved_device()
    torch.manual_seed(settings.seed)
    n_params = sum(math.prod(shape) for shape in source.weights.shapes.values())
    with calibration_threads(n_params, device, settings.threads):
        stream = StreamedCheckpoint(source.config, source.family, source.weights, cfg, device)
        values, report = calibrate_checkpoint(stream, cfg, calib_blocks, eval_blocks, settings, progress)
        if settings.steps > 0 and cfg.norms_qk:
            values = polish(
                source.path, source.family, cfg, values, calib_blocks, eval_blocks, settings, report, progress
            )
    return stream.patched.config, values, report


def _identity(source: Source, cfg):
    """The patched config and identity-initialised norm values, from a model built on the meta device."""
    from transformers import AutoModelForCausalLM

    from ..modeling.patch import patch_model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(source.config)
    patch_model(model, cfg)
    return model.config, {
        name: torch.full(prm.shape, initial_value(model, name)) for name, prm in new_norm_parameters(model).items()
    }


def _answer_agreement(source: Source, folder: Path, settings: CalibrationSettings, progress: bool) -> dict:
    """Answer agreement of the written (not yet renamed) folder with the source (:mod:`.agreement`): loads each whole
    model in float32 in turn, so it is skipped with ``agreement_tokens=0`` where a model does not fit."""
    import math

    from .agreement import folder_agreement
    from .calibrate import calibration_threads
    from .progress import Stage

    device = settings.resolved_device()
    n_params = sum(math.prod(shape) for shape in source.weights.shapes.values())
    with (
        Stage("answer agreement", 1, "checks", progress) as stage,
        calibration_threads(n_params, device, settings.threads),
    ):
        report = folder_agreement(source.path, folder, new_tokens=settings.agreement_tokens, device=device)
        stage.update(1, note=f"prefix {100 * report.prefix:.1f}%, top-1 {100 * report.top1:.1f}%")
    return report.to_dict()


def _write_folder(
    tmp: Path,
    source: Source,
    cfg,
    kind,
    patched_config,
    new_values,
    result,
    progress,
    model_name: str,
    settings: CalibrationSettings,
) -> WeightPlan:
    from .export import copy_side_files, write_config
    from .hub import write_model_card

    plan: WeightPlan = plan_weights(
        source.weights,
        source.family,
        cfg,
        new_values,
        source.config.get_text_config().num_hidden_layers,
        carry_native=result.report is None,
    )
    write_weights(source.weights, plan, tmp, progress)
    write_config(tmp, kind, patched_config, source.weights.dtype)
    copy_side_files(source.path, tmp)
    if result.report is not None and settings.agreement_tokens > 0:
        result.report.agreement = _answer_agreement(source, tmp, settings, progress)
    report = {
        "source": source.name,
        "export": kind,
        "export_note": result.export_note,
        "scheme": cfg.to_dict(),
        "calibration": None if result.report is None else result.report.to_dict(),
        "versions": installed_versions(),
        "card_model_name": model_name,
    }
    (tmp / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    write_model_card(
        tmp,
        model_name=model_name,
        source_dir=source.path,
        base_model=source.name,
        cfg=cfg,
        export=kind,
        report=result.report,
        export_note=result.export_note,
    )
    return plan

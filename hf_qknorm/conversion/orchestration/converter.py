"""Checkpoint conversion: ``hf_qknorm.convert`` and ``hf-qknorm convert``.

Takes a pretrained checkpoint, adds the scheme's norm weights initialised by calibration
(:mod:`hf_qknorm.conversion.calibration.calibrate`), and writes a folder that loads anywhere
(:mod:`hf_qknorm.conversion.output.export`) with a model card
(:mod:`hf_qknorm.conversion.output.hub`). Safe by construction:

- the source is only read, never written;
- every safetensors header is checked before any work starts, so a corrupt or truncated file is a clear error;
- the output is written into a temporary folder beside the destination and renamed into place when complete and
  checked (:mod:`hf_qknorm.conversion.orchestration.checks`: a finite report, the added tensors as computed, the
  verifier on the written folder); on any error, SIGINT or SIGTERM the temporary folder is removed, so nothing is left
  half-written, and one left by a killed run is removed by the next
  (:mod:`hf_qknorm.conversion.orchestration.tempdirs`); an existing destination is refused unless ``overwrite=True``;
- weights are written shard by shard from the source files (read one shard, add or transform its tensors, write
  it, update the index), so writing needs about one shard of memory. Calibration streams the checkpoint one decoder
  block at a time (:mod:`hf_qknorm.conversion.calibration.layerwise`); only the optional KL polish loads the whole
  model.

Under ``torchrun`` / ``accelerate launch`` (``WORLD_SIZE > 1``; :mod:`hf_qknorm.conversion.orchestration.ranks`)
:func:`convert` initialises a process group when none exists (gloo on the CPU; nccl and ``cuda:LOCAL_RANK`` when the
calibration device is CUDA) and destroys it at the end. Only healing is split: every rank calibrates, rank 0's values
are broadcast so that every rank heals from the same start, the heal text and the layer fits are shared out
(:mod:`hf_qknorm.conversion.healing.heal`), and the end-to-end stage runs on rank 0. Rank 0 alone checks the destination
and writes, verifies and uploads the folder (and logs and shows progress); the others wait and return the same
:class:`ConversionResult`, or raise :class:`~hf_qknorm.conversion.orchestration.ranks.FirstRankFailed` when rank 0's
work failed. Without healing the other ranks only wait. Without ``WORLD_SIZE`` nothing of this happens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...portable.names import PREFIX
from ...portable.norms import initial_value
from ...portable.schemes import QKNormConfig
from ..calibration.calibrate import CalibrationReport, CalibrationSettings, new_norm_parameters
from ..healing.heal import HealSettings
from ..output.hub import HubSettings
from ..output.writing import write_folder
from . import ranks
from .checks import VERIFY_MODES, check_report_finite, check_request, check_written, verify_output
from .destination import check_destination, default_destination
from .source import Source, inspect_source
from .tempdirs import check_writable, staging
from .texts import Texts, heal_text_blocks, read_texts, text_blocks

__all__ = ["ConversionResult", "convert"]


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


def convert(
    src=None,
    dst=None,
    config: QKNormConfig | str | None = None,
    calibration: CalibrationSettings | None = None,
    hub: HubSettings | None = None,
    *,
    heal: HealSettings | None = None,
    calibrate: bool = True,
    calibration_text=None,
    eval_text=None,
    export: str = "auto",
    overwrite: bool = False,
    verify: str = "full",
    progress: bool = True,
    log=None,
) -> ConversionResult:
    """Convert the checkpoint ``src`` (a folder or Hub id; ``None``: the bundled tiny Llama) to ``config``'s scheme
    with calibrated norm weights, and write a folder that loads without the plugin to ``dst``.

    On any failure nothing is left at ``dst`` (an existing ``dst`` is unchanged): ``ValueError``/``OSError`` for bad
    input, :class:`~hf_qknorm.conversion.orchestration.checks.ConversionCheckError` for a result that fails a check.
    Under ``torchrun`` every rank calls it with the same arguments and gets the same result. Every argument:
    docs/api.md (convert).
    """
    cfg, settings, hub = settings_objects(config, calibration, hub)
    if heal is not None and not isinstance(heal, HealSettings):
        raise TypeError(f"convert(): heal must be a HealSettings or None, got {type(heal).__name__}")
    if heal is not None and not calibrate:
        raise ValueError("healing starts from the calibrated model: drop calibrate=False (--no-calibration) or heal")
    if heal is not None:  # the defaults left to None made the scheme's (and checked) before any work
        heal = heal.for_scheme(cfg.scheme)
    if verify not in VERIFY_MODES:
        raise ValueError(f"unknown verify mode {verify!r}; choose one of {', '.join(VERIFY_MODES)}")
    token = check_request(settings, hub.repo_id, hub.token)  # a bad repo id or no token: fail now, not after hours
    request = _Request(
        src, dst, cfg, settings, hub, token, heal, calibrate, calibration_text, eval_text, export, overwrite, verify
    )
    with ranks.process_group(settings.resolved_device()) as device:
        if ranks.rank() != 0:  # rank 0 alone logs and shows progress
            progress, log = False, None
        return _convert(request, device, progress, log or _quiet)


def _quiet(*args, **kwargs):
    pass


@dataclass(frozen=True)
class _Request:
    """:func:`convert`'s arguments, checked."""

    src: object
    dst: object
    cfg: QKNormConfig
    settings: CalibrationSettings
    hub: HubSettings
    token: str | None
    heal: HealSettings | None
    calibrate: bool
    calibration_text: object
    eval_text: object
    export: str
    overwrite: bool
    verify: str


def _convert(req: _Request, device, progress: bool, log) -> ConversionResult:
    """:func:`convert` on every rank (one process: rank 0 of 1)."""
    from ..healing.heal import check_world
    from ..output.export import check_tokenizer_fits, has_tokenizer, resolve_export

    source = inspect_source(req.src, req.cfg)  # patching's refusals too, on the source's own layers, before any work
    config, family = source.config, source.family
    if req.cfg.eps is None:
        req = dataclasses.replace(req, cfg=dataclasses.replace(req.cfg, eps=family.norm_eps(config, "; pass --eps")))
    cfg = req.cfg

    def check():
        if req.heal is not None:
            check_world(req.heal, source.reusing)
            _check_heal_loads(source, req.heal)
            _check_heal_writes(source)
        dst = req.dst if req.dst is not None else default_destination(source.name, cfg)
        dst = check_destination(dst, source.path, req.overwrite)
        check_writable(dst)
        return dst

    dst = ranks.first(check)
    kind, note = resolve_export(req.export, config, cfg, family, source)
    texts = read_texts(req.calibration_text, req.eval_text) if req.calibrate else None
    if has_tokenizer(source.path):
        check_tokenizer_fits(source.path, source.config)
    elif req.calibrate:  # said here, before any work: Transformers 5.4 builds an empty tokenizer for such a folder
        raise ValueError(
            f"calibration needs the source's tokenizer, and {source.path} has no tokenizer files (tokenizer.json, "
            "tokenizer.model, vocab/merges); add it, or pass calibrate=False (--no-calibration)"
        )
    else:
        log(
            f"WARNING: {source.path} has no tokenizer files (tokenizer.json, tokenizer.model, vocab/merges): the "
            "converted folder will have none either; add the tokenizer the model was trained with before using or "
            "publishing it"
        )

    kind_of = (
        family.model_type if not family.text_model else f"{config.model_type} with a {family.model_type} text model"
    )
    log(
        f"converting {source.name} ({kind_of}, {source.weights.dtype}, "
        f"{len(source.weights.files)} weight file(s)) to {cfg.scheme}"
        f"{'' if not cfg.norms_qk else ' / ' + cfg.norm} -> {dst} as {kind}"
    )

    def prepare():
        if req.calibrate:
            return _calibrated(source, cfg, texts, req.settings, req.heal, device, progress)
        return *_identity(source, cfg), None

    # healing is shared out, so every rank calibrates and heals; without it rank 0 alone does the work
    prepared = prepare() if req.heal is not None else None
    return ranks.first(lambda: _write(req, source, dst, (kind, note), prepared or prepare(), progress, log))


def _check_heal_loads(source: Source, heal: HealSettings) -> None:
    """Refuse, before any work, the end-to-end healing stage (which trains the whole model as a causal LM) for a
    multimodal model that has no causal-LM class (LLaVA, Qwen2-VL; Gemma 3 has one). Its own heal text is generated
    through the image-text-to-text class and needs no refusal."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = source.config.model_type
    if not source.family.text_model or model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or not heal.end_to_end_tokens:
        return
    raise ValueError(
        f"healing a {model_type!r} model with --heal-end-to-end-tokens loads it whole as a causal LM, which "
        "Transformers has no class for (it is multimodal); heal it layer by layer: --heal-end-to-end-tokens 0 "
        "(HealSettings(end_to_end_tokens=0))"
    )


def _check_heal_writes(source: Source) -> None:
    """Refuse, before any work, healing a model whose attention parameters the checkpoint stores in a form a healed
    value cannot be written back into: made on loading by an operation other than a split of one tensor's rows (a
    fused q/k/v projection, written back joined; :mod:`hf_qknorm.conversion.output.keys`)."""
    from ...portable.families import UnsupportedModelError

    names, family = source.weights.names, source.family
    prefix = f"{family.layers}."
    for name, fused in names.fused.items():
        layer_part = name[len(prefix) :].split(".", 2) if name.startswith(prefix) else []
        if len(layer_part) == 3 and layer_part[1] == family.attention and name not in names.rows:
            key = next(k for keys in fused.sources.values() for k in keys)
            raise UnsupportedModelError(
                f"model type {family.model_type!r}: its checkpoint makes {name} on loading from {key} by "
                f"{', '.join(type(op).__name__ for op in fused.converter.operations)}, into which a healed value "
                "cannot be written back; convert it without --heal"
            )


def _write(req: _Request, source: Source, dst: Path, export, prepared, progress: bool, log) -> ConversionResult:
    """Check the report, write the folder (staged, checked, verified, renamed into place) and push it; ``export``
    is ``(kind, note)``, ``prepared`` ``(patched config, new values, report)``."""
    (kind, note), (patched_config, new_values, report), cfg = export, prepared, req.cfg
    settings, hub, family = req.settings, req.hub, source.family
    if report is not None:
        check_report_finite(report)
    result = ConversionResult(path=dst, export=kind, export_note=note, scheme=cfg, report=report)
    with staging(dst, req.overwrite, log) as tmp:
        plan = write_folder(
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
        verify_output(tmp, cfg, kind, req.verify, log, source=source, values=new_values)
    result.files = sorted(str(f.relative_to(dst)) for f in dst.rglob("*") if f.is_file())
    if report is not None:
        log(report.summary())
    if note and kind == "qknorm" and req.export == "auto" and family.model_type in ("llama", "mistral"):
        written = PREFIX + source.config.model_type
        log(f"note: written as {written} (trust_remote_code) rather than {_plain_name(source)}: {note}")
    log(f"wrote {dst} ({kind}): {', '.join(result.files)}")
    if hub.repo_id:
        from ..output.hub import push

        try:
            result.pushed_url = push(
                dst,
                hub.repo_id,
                private=hub.private,
                revision=hub.revision,
                commit_message=hub.commit_message,
                token=req.token,
            )
        except OSError as exc:
            raise OSError(
                f"{exc}; the converted model is complete in {dst}: upload it later with "
                f"`hf-qknorm push {dst} {hub.repo_id}`"
            ) from exc
        log(f"pushed to {result.pushed_url}")
    return result


def _plain_name(source: Source) -> str:
    """What a ``qwen3`` export of ``source`` is called in messages."""
    if source.family.text_model:
        return f"a plain {source.config.model_type} with a qwen3 text model"
    return "qwen3"


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


def _calibrated(source: Source, cfg, texts: Texts, settings: CalibrationSettings, heal, device, progress: bool):
    """Layer-by-layer calibration streamed from the source files (:mod:`hf_qknorm.conversion.calibration.layerwise`),
    then the optional end-to-end KL polish (``settings.steps > 0``), which loads the whole model, then the optional
    healing, on ``device``. With more than one rank every rank calibrates; healing starts from rank 0's values."""
    import math

    from transformers import AutoTokenizer

    from ..calibration.calibrate import calibration_threads, polish
    from ..calibration.layerwise import calibrate_checkpoint
    from ..calibration.streaming import StreamedCheckpoint

    try:
        tokenizer = AutoTokenizer.from_pretrained(source.path)
    except Exception as exc:
        raise ValueError(
            f"calibration needs the source's tokenizer, which could not be loaded from "
            f"{source.path} ({type(exc).__name__}: {exc}); add it, or pass calibrate=False "
            "(--no-calibration)"
        ) from exc
    block_len = min(settings.block_len, source.family.training_length(source.config))
    calib_blocks = text_blocks(
        texts.calibration, tokenizer, block_len, settings.calibration_blocks, texts.calibration_label
    )
    eval_blocks = text_blocks(texts.held_out, tokenizer, block_len, settings.eval_blocks, texts.held_out_label)
    torch.manual_seed(settings.seed)
    n_params = sum(math.prod(shape) for shape in source.weights.shapes.values())
    with calibration_threads(n_params, device, settings.threads):
        stream = StreamedCheckpoint(source.config, source.family, source.weights, cfg, device)
        values, report = calibrate_checkpoint(stream, cfg, calib_blocks, eval_blocks, settings, progress)
        if settings.steps > 0 and cfg.norms_qk:
            values = polish(
                source.path, source.family, cfg, values, calib_blocks, eval_blocks, settings, report, progress
            )
        if heal is not None:
            from ..healing.heal import heal_checkpoint, heal_text

            values = ranks.broadcast(values)  # every rank heals from rank 0's calibration
            heal = heal.for_scheme(cfg.scheme)  # convert() resolved it already; the same for a direct caller
            parts, generated, gen_seconds = heal_text(source.path, tokenizer, texts.calibration, heal, device, progress)
            label = texts.calibration_label + (
                " mixed with the original's own answers" if len(parts) == 1 and generated else ""
            )
            heal_blocks = heal_text_blocks(parts, tokenizer, block_len, heal.blocks, label)
            values, healed = heal_checkpoint(
                stream, values, heal_blocks, eval_blocks, heal, settings.batch_size, progress
            )
            healed.generated_tokens, healed.generation_seconds = generated, gen_seconds
            healed.seconds += gen_seconds
            if heal.end_to_end_tokens:
                from ..healing.endtoend import end_to_end

                def stage():  # every layer at once: rank 0 alone
                    out = end_to_end(
                        source.path,
                        source.family,
                        cfg,
                        values,
                        heal_blocks,
                        eval_blocks,
                        heal,
                        healed,
                        device,
                        progress,
                    )
                    return out, healed

                values, healed = ranks.first(stage)
            report.heal = healed.to_dict()
    return stream.patched.config, values, report


def _identity(source: Source, cfg):
    """The patched config and identity-initialised norm values (a model's own per-head norms carried into the
    scheme's that replace them, as :func:`hf_qknorm.patch_model` does), from models built on the meta device."""
    from ...modeling.patch import patch_model
    from ...portable.layout import find_layers
    from ..output.forms import native_values
    from ..output.shards import skeleton

    original, model = skeleton(source.config), skeleton(source.config)
    patch_model(model, cfg)
    values = {
        name: torch.full(prm.shape, initial_value(model, name)) for name, prm in new_norm_parameters(model).items()
    }
    if source.family.native:
        for i in range(len(find_layers(original, source.family))):
            values.update(native_values(original, model, source.family, source.weights, i))
    return model.config, values

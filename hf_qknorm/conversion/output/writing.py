"""What a conversion writes into its staging folder: the weights shard by shard, the config, the side files, the
answer agreement of the written model, ``qknorm_conversion.json`` and the model card."""

from __future__ import annotations

import json
from pathlib import Path

from ...modeling.saved import auto_class
from ...upstream import installed_versions
from ..calibration.calibrate import CalibrationSettings
from ..orchestration.source import Source
from .shards import WeightPlan, plan_weights, write_weights

__all__ = ["REPORT_FILE", "write_folder"]

REPORT_FILE = "qknorm_conversion.json"


def _answer_agreement(source: Source, folder: Path, settings: CalibrationSettings, progress: bool) -> dict:
    """Answer agreement of the written (not yet renamed) folder with the source (:mod:`.agreement`): loads each whole
    model in float32 in turn, so it is skipped with ``agreement_tokens=0`` where a model does not fit."""
    import math

    from ..calibration.calibrate import calibration_threads
    from ..orchestration.agreement import folder_agreement
    from ..orchestration.progress import Stage

    device = settings.resolved_device()
    n_params = sum(math.prod(shape) for shape in source.weights.shapes.values())
    with (
        Stage("answer agreement", 1, "checks", progress) as stage,
        calibration_threads(n_params, device, settings.threads),
    ):
        report = folder_agreement(source.path, folder, new_tokens=settings.agreement_tokens, device=device)
        stage.update(1, note=f"prefix {100 * report.prefix:.1f}%, top-1 {100 * report.top1:.1f}%")
    return report.to_dict()


def write_folder(
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
    from .export import copy_side_files, native_form, stored_values, write_config
    from .hub import write_model_card

    forms = None
    if cfg.removes_prenorm:
        from .forms import prenorm_forms
        from .shards import skeleton

        forms = prenorm_forms(skeleton(source.config), source.family, source.weights)
    if kind == "native":  # the model's own norms keep their convention (Gemma's 1 + w stored as w)
        offsets, why = native_form(source, cfg)
        if offsets is None:
            raise ValueError(f"cannot export as a plain {source.family.model_type} model: {why}")
        new_values = stored_values(new_values, offsets, source.family, source.weights)
    plan: WeightPlan = plan_weights(source.weights, source.family, cfg, new_values, forms)
    write_weights(source.weights, plan, tmp, progress)
    write_config(tmp, kind, patched_config, source.weights.dtype, source.config)
    copy_side_files(source.path, tmp)
    if result.report is not None and settings.agreement_tokens > 0:
        result.report.agreement = _answer_agreement(source, tmp, settings, progress)
    report = {
        "source": source.name,
        "export": kind,
        "export_note": result.export_note,
        "load_with": auto_class(source.config).__name__,  # a multimodal model's: AutoModelForImageTextToText, ...
        "language_model": source.family.text_model,  # its dotted path in a multimodal model, else None
        "scheme": cfg.to_dict(),
        "calibration": None if result.report is None else result.report.to_dict(),
        "heal": None if result.report is None else result.report.heal,
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
        load_with=report["load_with"],
    )
    return plan

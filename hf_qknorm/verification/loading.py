"""Loading a saved folder for :func:`hf_qknorm.verification.verify_folders`, with its weights checked first.

The verifier compares a model with the float64 reference computed from the *loaded* weights, so a folder whose
weights did not all load -- a tensor deleted (Transformers initialises it afresh and only logs a report), a tensor the
model does not read, a norm gain stored as integers (cast without a word) -- would verify OK while not being the
saved model. Such a folder fails verification here, in one line naming the tensors (:class:`FolderWeightsError`);
a ``config.json`` whose sizes disagree with the weights is an input error naming a tensor and both shapes.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

from ..portable.names import NORM_SLOTS
from ..portable.weights import SchemeWeightsError, keys_text
from .report import Check, VerifyReport

_WHOLE_MODEL_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")  # head, language model (and vision)


class FolderWeightsError(ValueError):
    """A folder's weights are not those of the model its ``config.json`` describes: verification fails."""


def load_folder(path: Path):
    """``AutoModelForCausalLM.from_pretrained(path)`` (a multimodal model's ``AutoModelForImageTextToText``:
    :func:`~hf_qknorm.modeling.saved.auto_class`) after checking that the weights are exactly the model's: raises
    :class:`FolderWeightsError` (missing, unexpected or non-floating-point norm tensors) or ``ValueError``
    (``config.json`` disagrees with the tensors' shapes)."""
    from transformers import AutoConfig

    from ..modeling.saved import auto_class

    try:  # ignore_mismatched_sizes: the mismatch comes back in the info, to be named below
        with quiet_transformers():  # its load report is multi-line and says less than the line below
            model, info = auto_class(AutoConfig.from_pretrained(path)).from_pretrained(
                path, output_loading_info=True, ignore_mismatched_sizes=True
            )
    except SchemeWeightsError as exc:  # the patched classes' own rule (hf_qknorm.portable.structure)
        raise FolderWeightsError(str(exc)) from exc
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        key, saved, wanted = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise ValueError(
            f"config.json disagrees with the weights: {key} is {tuple(saved)} in the "
            f"checkpoint, {tuple(wanted)} by config.json{more}; fix the sizes in config.json"
        )
    missing, unexpected = _outside_the_head(model, info.get("missing_keys"), info.get("unexpected_keys"))
    problems = [f"missing {keys_text(missing)}"] if missing else []
    problems += [f"unexpected {keys_text(unexpected)}"] if unexpected else []
    bad_values = _bad_norm_values(path)
    problems += [
        f"{keys_text(keys)} stored as {dtype} (not floating point)"
        for dtype, keys in sorted(bad_values.items())
        if dtype != _NON_FINITE
    ]
    problems += [f"{keys_text(bad_values[_NON_FINITE])} with NaN/inf values"] if _NON_FINITE in bad_values else []
    if problems:
        raise FolderWeightsError(
            f"{'; '.join(problems)}: the model loaded from these weights is not the saved "
            "model (Transformers would initialise what is missing afresh and skip the rest)"
        )
    return model


def _outside_the_head(model, missing, unexpected) -> tuple[list[str], list[str]]:
    """The keys that count: every missing key, and every unexpected key of a module the model has (tensors of whole
    layers that config.json leaves out are not read, as when a config is cut to fewer layers on purpose --
    ``hf-qknorm convert`` checks its output that way); for a folder saved from another head class (the base model,
    a classifier), which the verifier loads as a causal LM, only those of the base model."""
    missing = sorted(missing or ())
    unexpected = sorted(k for k in unexpected or () if _has_module(model, k.rpartition(".")[0].rpartition(".")[0]))
    archs = getattr(model.config, "architectures", None) or []
    if not archs or any(a.endswith(_WHOLE_MODEL_HEADS) for a in archs):
        return missing, unexpected
    prefix = f"{model.base_model_prefix}."
    return [k for k in missing if k.startswith(prefix)], [k for k in unexpected if k.startswith(prefix)]


def _has_module(model, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


_NON_FINITE = "non-finite"


def _bad_norm_values(path: Path) -> dict[str, list[str]]:
    """safetensors dtype -> norm tensors stored in it, for norm tensors that are not floating point; and
    ``_NON_FINITE`` -> floating-point norm tensors holding NaN or inf (the model computes NaN from them, and the
    probes could only say that the layers are off). Norm tensors are small: reading them all is cheap."""
    import torch
    from safetensors import safe_open

    out: dict[str, list[str]] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if key.rpartition(".")[0].rpartition(".")[2] in NORM_SLOTS:
                    dtype = f.get_slice(key).get_dtype()
                    if not dtype.startswith(("F", "BF")):
                        out.setdefault(dtype, []).append(key)
                    elif not bool(torch.isfinite(f.get_tensor(key)).all()):
                        out.setdefault(_NON_FINITE, []).append(key)
    return out


def weights_report(path: Path, reason: str, how: str) -> VerifyReport:
    """A failed report for a folder whose weights do not load as they are (nothing was probed)."""
    import json

    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        raw = {}
    raw = raw if isinstance(raw, dict) else {}
    archs = raw.get("architectures") or [raw.get("model_type", "?")]
    qknorm = raw.get("qknorm") if isinstance(raw.get("qknorm"), dict) else {}
    scheme = qknorm.get("scheme", "unpatched") + (f" / {qknorm['norm']}" if qknorm.get("norm") else "")
    return VerifyReport(
        model=str(archs[0]),
        scheme=scheme,
        backend=None,
        cache="-",
        dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "?"),
        checks=[Check(None, "weights", math.nan, math.nan, note=reason)],
        source=f"{path}, {how}",
    )


@contextmanager
def quiet_transformers():
    """Transformers' load reports and progress bars off meanwhile (what they say is said here in one line)."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()

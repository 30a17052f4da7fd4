"""The conversion column of the coverage table (:mod:`hf_qknorm.verification.coverage`): a tiny checkpoint of each
patched model type converted with every variant of :data:`VARIANTS`, and every written folder reloaded without the
plugin.

Per model type (:func:`check_conversions`) a tiny model of the type (:mod:`hf_qknorm.verification.tiny`; a
multimodal type's whole model, of which its language model is converted; its vocabulary widened to the bundled
tokenizer's, its norms given trained-looking gains so folds and carried gains matter) is saved with the bundled
tokenizer and converted by :func:`hf_qknorm.convert` with each variant: calibration streamed layer by layer, then
the written folder checked before it is renamed into place -- its logits against the converted model in memory
(:func:`hf_qknorm.patch_model` of the source with the calibrated norms), and against the float64 reference of
:func:`hf_qknorm.verify` where that does not refuse the type. Then every written folder is loaded in one fresh
interpreter that cannot import the plugin (:mod:`hf_qknorm.verification.plain`: remote code, or plain Transformers
for a plain export) and its logits compared with the same folder's loaded with the plugin.

A variant is ``ok`` with the format written, ``refused`` with :func:`hf_qknorm.convert`'s one-line reason (the same
as patching's: ``qkv_norm`` on a parallel block), or ``FAIL``. A model type is ``converted`` when every variant is ok,
or every one but those patching refuses; ``refused`` when every variant is; ``FAIL`` when any variant fails;
``untested`` when no tiny checkpoint of it can be saved.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...verification.coverage import CONVERTED, FAIL, PATCHED, REFUSED, UNTESTED

# scheme, norm: the default, a plain export where one exists (Qwen3 for a Llama, the type itself for a model with its
# own RMS q/k norms), the l2/lp logit scale, the cap alone, qkv_norm's fold
VARIANTS = (
    ("qk_norm_cap", "layernorm"),
    ("qk_norm", "layernorm"),
    ("qk_norm", "rmsnorm"),
    ("qk_norm", "lp"),
    ("qkv_norm", "layernorm"),
    ("soft_cap", None),
)
SOURCE_VOCAB = 2112  # the bundled tokenizer's 2,048 tokens fit
PROBE_SHAPE, PROBE_PAD = (2, 12), 3


def settings():
    """Calibration small enough for a table of seventy types: every stage runs, on a few tokens."""
    from ..calibration.calibrate import CalibrationSettings

    return CalibrationSettings(
        block_len=16, calibration_blocks=2, eval_blocks=1, local_steps=2, batch_size=2, agreement_tokens=0
    )


@dataclass
class ConversionResult:
    """One model type's conversion column: its status, a note, and each variant's result."""

    status: str
    reason: str = ""
    variants: dict = field(default_factory=dict)  # "scheme/norm" -> "ok (<format>)", "refused: ..." or "FAIL: ..."


def variant_key(scheme: str, norm: str | None) -> str:
    return f"{scheme}/{norm}" if norm else scheme


def tiny_source(model_type: str, folder: Path, seed: int = 0) -> Path:
    """A tiny checkpoint of ``model_type`` saved to ``folder`` with the bundled tokenizer: the coverage table's tiny
    config (:func:`hf_qknorm.verification.tiny.tiny_config`; a multimodal type's:
    :func:`~hf_qknorm.verification.tiny.tiny_multimodal_config`, its special tokens above the tokenizer's ids) with
    room for the tokenizer's ids, every 1-d parameter (norm gains and biases) moved off its initial value so that
    what a conversion folds or carries shows."""
    from ...data import bundled_model_dir
    from ...modeling.saved import auto_class
    from ...verification.loading import quiet_transformers
    from ...verification.tiny import builder, fit_mrope, is_multimodal, tiny_config, tiny_multimodal_config

    if is_multimodal(_default_config(model_type)):
        config = _special_ids_on_top(tiny_multimodal_config(model_type))
        with torch.device("meta"):  # multimodal RoPE sections sized to the tiny heads, as the patching checks do
            fit_mrope(auto_class(config).from_config(copy.deepcopy(config)), config)
    else:
        config = _per_layer_lists_cut(model_type, tiny_config(model_type))
        _widen_vocab(config)
    torch.manual_seed(seed)
    kwargs = {"experts_implementation": "eager"} if hasattr(config, "_experts_implementation") else {}
    model = builder(config, auto_class(config)).from_config(config, **kwargs)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for prm in model.parameters():
            if prm.dim() == 1:
                prm.add_(0.3 * torch.randn(prm.shape, generator=gen, dtype=prm.dtype))
    with quiet_transformers():
        model.save_pretrained(folder)
        if is_multimodal(config):  # a type whose own save and load loses tensors has no tiny checkpoint to convert
            _, info = auto_class(config).from_pretrained(folder, output_loading_info=True)
            if info.get("missing_keys"):
                lost = sorted(info["missing_keys"])
                raise ValueError(
                    f"Transformers' own save and load of the tiny {model_type} loses {len(lost)} tensor(s) "
                    f"({lost[0]}, ...)"
                )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(bundled_model_dir() / name, Path(folder) / name)
    return Path(folder)


def _per_layer_lists_cut(model_type: str, config):
    """``config`` with every per-layer list its default config states for each of its layers (Laguna's heads per
    layer) cut to the tiny config's depth: a config that checks their lengths saves only so."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    depth, layers = getattr(CONFIG_MAPPING[model_type](), "num_hidden_layers", None), config.num_hidden_layers
    if isinstance(depth, int) and isinstance(layers, int) and depth > layers:
        for name, value in config.to_dict().items():
            if isinstance(value, list) and len(value) == depth:
                setattr(config, name, value[:layers])
    return config


def _default_config(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]()


def _special_ids_on_top(config):
    """A multimodal ``config`` with the text vocabulary widened to :data:`SOURCE_VOCAB` and its special tokens'
    ids (image, video, ...) at its top, above the tokenizer's: calibration text never holds an image token."""
    from ...verification.tiny import special_ids_on_top

    _widen_vocab(config.get_text_config())
    return special_ids_on_top(config, SOURCE_VOCAB)


def _widen_vocab(text_config) -> None:
    """The text vocabulary at :data:`SOURCE_VOCAB`, and a second one of the same tokens where the config has it
    (Gemma 4's per-layer embeddings)."""
    text_config.vocab_size = SOURCE_VOCAB
    if isinstance(getattr(text_config, "vocab_size_per_layer_input", None), int):
        text_config.vocab_size_per_layer_input = SOURCE_VOCAB


def probe_inputs(vocab: int = SOURCE_VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of two rows, the first left-padded: the ids and the attention mask."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, min(vocab, 512), PROBE_SHAPE, generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :PROBE_PAD] = 0
    return ids, mask


def convert_variants(model_type: str, workdir: Path, variants=VARIANTS) -> tuple[dict, list[dict]]:
    """Convert a tiny checkpoint of ``model_type`` (in ``workdir``) with each variant; returns each variant's result
    and, for those converted, a job for :func:`reload_without_plugin` (with the logits the folder gives with the
    plugin)."""
    from ...modeling.saved import auto_class
    from ...portable.families import UnsupportedModelError, text_forward_path, text_runner
    from ...portable.schemes import QKNormConfig
    from ...verification.loading import quiet_transformers
    from ..output.shards import load_pretrained
    from .converter import convert

    source = tiny_source(model_type, Path(workdir) / "source")
    ids, mask = probe_inputs()
    results, jobs = {}, []
    for scheme, norm in variants:
        key = variant_key(scheme, norm)
        out = Path(workdir) / key.replace("/", "-")
        messages: list[str] = []
        log = messages.append
        try:
            cfg = QKNormConfig(scheme, norm=norm, p=3.0 if norm == "lp" else None)
            result = convert(
                source,
                out,
                cfg,
                settings(),
                calibration_text=_text(),
                verify="plugin",
                progress=False,
                log=log,
            )
        except UnsupportedModelError as exc:
            results[key] = "refused: " + _line(exc)
            continue
        except Exception as exc:
            results[key] = f"FAIL: {type(exc).__name__}: {_line(exc)}"
            continue
        fmt = _format(result, source)
        reference = "float64" if not any(m.startswith("float64 reference not run") for m in messages) else "patch"
        results[key] = f"ok ({fmt}; {reference})"
        with quiet_transformers():
            model = load_pretrained(out).eval()
        with torch.no_grad():
            logits = text_runner(model)(input_ids=ids, attention_mask=mask).logits.float()
        jobs.append(
            {
                "key": f"{model_type}:{key}",
                "path": str(out),
                "remote": result.export == "qknorm",
                "auto": auto_class(model.config).__name__,
                "text_forward": text_forward_path(model),
                "ids": ids.tolist(),
                "mask": mask.tolist(),
                "_want": logits,
            }
        )
    return results, jobs


def _format(result, source: Path) -> str:
    import json

    if result.export == "qknorm":
        return "remote code"
    model_type = json.loads((source / "config.json").read_text())["model_type"]
    if result.export == "qwen3":
        written = json.loads((result.path / "config.json").read_text())
        return "plain qwen3" if written["model_type"] == "qwen3" else f"plain {model_type} with a qwen3 text model"
    return "plain " + model_type


def reload_without_plugin(jobs: list[dict]) -> dict[str, str]:
    """Load every job's folder without the plugin (one fresh interpreter) and compare its logits with the plugin's:
    key -> ``"ok"`` or ``"FAIL: ..."``."""
    from ...verification.plain import logits_without_plugin

    if not jobs:
        return {}
    try:
        got = logits_without_plugin([{k: v for k, v in job.items() if not k.startswith("_")} for job in jobs])
    except Exception as exc:
        return {job["key"]: f"FAIL: reloading without the plugin: {_line(exc)}" for job in jobs}
    out = {}
    ids_pad = PROBE_PAD
    for job in jobs:
        row, want = got.get(job["key"], {"error": "nothing returned"}), job["_want"]
        if "error" in row:
            out[job["key"]] = f"FAIL: without the plugin: {row['error']}"
            continue
        logits = row["logits"]
        diff = max(
            float((logits[1] - want[1]).abs().max()), float((logits[0, ids_pad:] - want[0, ids_pad:]).abs().max())
        )
        scale = float(want.abs().max())
        out[job["key"]] = (
            "ok" if diff <= 1e-4 * max(scale, 1e-30) else f"FAIL: without the plugin, logits differ by {diff:.2e}"
        )
    return out


def summarise(results: dict) -> ConversionResult:
    """The column's status from each variant's result (module docstring)."""
    fails = {k: v for k, v in results.items() if v.startswith("FAIL")}
    refused = {k: v for k, v in results.items() if v.startswith("refused")}
    if fails:
        key = sorted(fails)[0]
        return ConversionResult(FAIL, f"{key}: {fails[key][len('FAIL: ') :]}", results)
    ok = {k: v for k, v in results.items() if v.startswith("ok")}
    if not ok:
        first = refused[sorted(refused)[0]][len("refused: ") :] if refused else "no variant converted"
        return ConversionResult(REFUSED, first, results)
    formats = sorted({v[len("ok (") :].split(";")[0] for v in ok.values()})
    checked = "float64 reference" if all(v.endswith("float64)") for v in ok.values()) else "patch_model's logits"
    note = f"{len(ok)} variant(s) reloaded without the plugin ({', '.join(formats)}); checked against {checked}"
    if refused:
        key = sorted(refused)[0]
        note += f"; {key} refused: {refused[key][len('refused: ') :]}"
    return ConversionResult(CONVERTED, note, results)


def check_conversions(model_types: list[str], progress=None, variants=VARIANTS) -> dict[str, ConversionResult]:
    """:func:`convert_variants` for each model type, then one reload without the plugin for all of them."""
    out, jobs_of, results_of = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="hf_qknorm_coverage_") as tmp:
        for model_type in model_types:
            work = Path(tmp) / model_type
            work.mkdir()
            try:
                results_of[model_type], jobs_of[model_type] = convert_variants(model_type, work, variants)
            except Exception as exc:  # no tiny checkpoint of the type could be saved
                out[model_type] = ConversionResult(UNTESTED, f"no tiny checkpoint ({type(exc).__name__}: {_line(exc)})")
        reloaded = reload_without_plugin([job for jobs in jobs_of.values() for job in jobs])
    for model_type, results in results_of.items():
        for job in jobs_of[model_type]:
            key = job["key"].split(":", 1)[1]
            if reloaded.get(job["key"], "FAIL: not reloaded") != "ok":
                results[key] = reloaded.get(job["key"], "FAIL: not reloaded")
        out[model_type] = summarise(results)
        if progress is not None:
            progress(model_type, out[model_type])
    return out


_TEXT: list[str] = []


def _text() -> str:
    if not _TEXT:
        from ...data import bundled_text

        _TEXT.append(bundled_text()[:4000])
    return _TEXT[0]


def _line(exc) -> str:
    """The first line of an exception's message (and the second where the first only announces it)."""
    text = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not text:
        return type(exc).__name__
    return (" ".join(text[:2]) if text[0].endswith(":") else text[0])[:300]


def add_conversions(results: list, variants=VARIANTS) -> None:
    """Fill in the conversion column of the coverage table's ``results`` (one chunk of
    :class:`~hf_qknorm.verification.coverage.TypeResult`) for the patched types:
    ``coverage(..., chunk_hook=add_conversions)``; ``variants``: the (scheme, norm) pairs converted."""
    patched = [r for r in results if r.status == PATCHED]
    try:
        found = check_conversions([r.model_type for r in patched], variants=variants)
    except Exception as exc:  # the conversion check itself broke
        found = {}
        for r in patched:
            r.conversion, r.conversion_note = FAIL, f"the check crashed: {type(exc).__name__}: {_line(exc)}"
    for r in patched:
        if r.model_type in found:
            got = found[r.model_type]
            r.conversion, r.conversion_note, r.conversion_variants = got.status, got.reason, got.variants

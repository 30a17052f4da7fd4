"""``verify(model)`` and ``verify_folder(path, no_plugin=...)``: probe a model as it is configured and judge every
attention layer against the float64 formula reference (see :mod:`.probe` and :mod:`.checks`)."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import textwrap
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..modeling.saved import auto_class, read_config
from ..portable.names import NORM_SLOTS, PREFIX
from .checks import build_report, check_tolerance
from .layers import ReferenceModel
from .loading import FolderWeightsError, load_folder, weights_report
from .probe import run_probes
from .report import Check, VerifyReport

logger = logging.getLogger(__name__)


def verify(model: nn.Module, *, tolerance: float | None = None, generate: bool = True) -> VerifyReport:
    """Check that ``model`` -- as configured: its attention backend, its generation cache -- computes its scheme: every
    attention layer's output against :func:`hf_qknorm.reference.attention_layer_reference` in float64. The model is
    left as it was. Returns a :class:`VerifyReport` whose ``ok`` is False when an error exceeds the tolerance or a
    cap, norm or mask is not applied. Arguments: docs/api.md (verify)."""
    tolerance = check_tolerance(tolerance)
    ref = ReferenceModel(model)
    captured = run_probes(model, ref.plan(generate=generate))
    report = build_report(ref, captured, tolerance=tolerance, source="in process")
    report.checks += [Check(None, "adapter", math.nan, math.nan, note=note) for note in _adapter_problems(model)]
    return _log(report)


def _adapter_problems(model) -> list[str]:
    """A peft adapter that trains norm modules (``modules_to_save``) the model lacks: saved from a patched model and
    loaded into an unpatched one. peft loads it without a word and drops the trained norms; the model then computes
    plain attention faithfully, so the probes alone would pass it."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict):
        return []
    have = {name.rpartition(".")[2] for name, _ in model.named_modules()}
    out = []
    for adapter, config in configs.items():
        lacking = sorted(set(getattr(config, "modules_to_save", None) or ()) & set(NORM_SLOTS) - have)
        if lacking:
            out.append(
                f"peft adapter {adapter!r} trains {', '.join(lacking)} (modules_to_save), which this model "
                "lacks: the adapter was saved from a model patched by hf_qknorm; patch the base model with "
                "the same scheme before loading it"
            )
    return out


@dataclass
class FolderResult:
    """One folder of :func:`verify_folders`: its report, or the one-line reason it could not be verified (and the
    traceback of that error, which ``--debug`` prints)."""

    path: Path
    report: VerifyReport | None = None
    error: str | None = None
    traceback: str | None = None


def verify_folder(
    path,
    *,
    no_plugin: bool = False,
    device: str = "cpu",
    tolerance: float | None = None,
    generate: bool = True,
    timeout: float = 1800,
) -> VerifyReport:
    """Verify a saved model folder: loaded with the plugin and :func:`verify`-ed, or (``no_plugin=True``) loaded as a
    user without the package would, in a subprocess that cannot import ``hf_qknorm``. A folder whose weights are not
    exactly its model's gets a failed report; one that cannot be verified at all raises ``FileNotFoundError``,
    ``ValueError`` or ``RuntimeError``. Arguments: docs/api.md (verify_folder)."""
    result = verify_folders(
        [path], no_plugin=no_plugin, device=device, tolerance=tolerance, generate=generate, timeout=timeout
    )[0]
    if result.report is None:
        raise RuntimeError(result.error)
    return result.report


def verify_folders(
    paths,
    *,
    no_plugin: bool = False,
    device: str = "cpu",
    tolerance: float | None = None,
    generate: bool = True,
    timeout: float = 1800,
) -> list[FolderResult]:
    """:func:`verify_folder` for several folders; with ``no_plugin`` they share one subprocess. One folder's error
    is recorded in its :class:`FolderResult` and does not stop the others."""
    tolerance = check_tolerance(tolerance)
    results = [FolderResult(Path(p)) for p in paths]
    refs: dict[int, ReferenceModel] = {}
    jobs = []
    for i, res in enumerate(results):
        try:
            if not res.path.is_dir():
                raise FileNotFoundError("folder not found")  # the reported line starts with the folder
            config = read_config(res.path)  # one-line errors for a missing file or JSON object
            model = load_folder(res.path).to(device)
            if not no_plugin:
                res.report = verify(model, tolerance=tolerance, generate=generate)
                res.report.source = f"{res.path}, loaded with hf_qknorm"
                continue
            refs[i] = ReferenceModel(model)
            model_type = str(config.get("model_type", ""))
            jobs.append(
                {
                    "key": str(i),
                    "path": str(res.path.resolve()),
                    "remote": model_type.startswith(PREFIX),
                    "auto": auto_class(model.config).__name__,  # a multimodal model: AutoModelForImageTextToText
                    "device": device,
                    "plan": refs[i].plan(generate=generate),
                }
            )
        except FolderWeightsError as exc:  # the folder is not the model it claims to be: verification fails
            res.report = _log(weights_report(res.path, _one_line(exc), "loaded with hf_qknorm"))
        except Exception as exc:  # reported per folder, in one line (the traceback for --debug)
            res.error = _one_line(exc)
            res.traceback = traceback.format_exc()
    if jobs:
        try:
            captured = capture_without_plugin(jobs, timeout=timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            captured = {job["key"]: {"error": _one_line(exc), "traceback": traceback.format_exc()} for job in jobs}
        for job in jobs:
            i, got = int(job["key"]), captured.get(job["key"], {"error": "the subprocess returned nothing"})
            if "error" in got:
                results[i].error = f"loading without hf_qknorm failed: {got['error']}"
                results[i].traceback = got.get("traceback")
                continue
            how = "remote code, trust_remote_code=True" if job["remote"] else "plain Transformers"
            results[i].report = _log(
                build_report(
                    refs[i], got, tolerance=tolerance, source=f"{results[i].path}, loaded without hf_qknorm ({how})"
                )
            )
    return results


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _log(report: VerifyReport) -> VerifyReport:
    logger.debug("%s", report)
    if report.ok:
        logger.info("hf_qknorm verify: %s OK (%s)", report.model, report.summary())
    else:
        logger.warning("hf_qknorm verify: %s FAILED: %s", report.model, "; ".join(report.problems()[:4]))
    return report


# -------------------------------------------------------------------------------------------------------------------
# the subprocess that cannot import hf_qknorm
# -------------------------------------------------------------------------------------------------------------------
_RUNNER = textwrap.dedent("""
    import importlib.util, json, sys, traceback
    sys.modules["hf_qknorm"] = None  # any import of the plugin now fails: the folder must stand on its own
    import torch
    import transformers

    jobs = json.load(open(sys.argv[1]))
    torch.set_num_threads(int(sys.argv[4]))  # the caller's setting: extra threads on tiny models only contend
    spec = importlib.util.spec_from_file_location("qknorm_verify_probe", sys.argv[3])
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)  # the probe module imports nothing but torch
    out = {}
    for job in jobs:
        try:
            auto = getattr(transformers, job.get("auto", "AutoModelForCausalLM"))
            model = auto.from_pretrained(job["path"], trust_remote_code=job["remote"])
            out[job["key"]] = probe.run_probes(model.to(job["device"]), job["plan"])
            del model
        except Exception as exc:
            out[job["key"]] = {"error": (type(exc).__name__ + ": " + str(exc)).strip().splitlines()[0],
                               "traceback": traceback.format_exc()}
    loaded = [n for n, m in sys.modules.items() if n.startswith("hf_qknorm") and m is not None]
    assert not loaded, f"hf_qknorm was imported: {loaded}"
    torch.save(out, sys.argv[2])
""")


def capture_without_plugin(jobs: list[dict], *, timeout: float = 1800) -> dict:
    """Run :func:`.probe.run_probes` for each job (``key``, folder ``path``, ``remote``: trust_remote_code,
    ``device``, ``plan``, optional ``auto``: the Auto class to load with) in one fresh interpreter where
    ``hf_qknorm`` cannot be imported; returns key -> what it recorded (or ``{"error": ...}``). Transformers'
    remote-code module cache is private to the run, so the code executed is each folder's own, as it is now. The
    subprocess uses as many intra-op threads as this process. ``HF_QKNORM_PYTHON`` names another interpreter to use."""
    with tempfile.TemporaryDirectory(prefix="hf_qknorm_verify_") as tmp:
        tmp = Path(tmp)
        (tmp / "jobs.json").write_text(json.dumps(jobs))
        (tmp / "runner.py").write_text(_RUNNER)
        env = {**os.environ, "HF_MODULES_CACHE": str(tmp / "modules")}
        python = os.environ.get("HF_QKNORM_PYTHON", sys.executable)
        cmd = [
            python,
            str(tmp / "runner.py"),
            str(tmp / "jobs.json"),
            str(tmp / "out.pt"),
            str(Path(__file__).with_name("probe.py")),
            str(torch.get_num_threads()),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp, env=env)
        if res.returncode != 0:
            tail = [line for line in (res.stderr or res.stdout).strip().splitlines() if line.strip()]
            raise RuntimeError(f"the subprocess without hf_qknorm failed: {tail[-1] if tail else res.returncode}")
        return torch.load(tmp / "out.pt", weights_only=True)

"""What ``convert`` checks before it renames its output into place: a report that is not finite, added tensors that
were not written as computed, and the verifier on the written folder (with the plugin, and through the shipped
remote code without it). Each broken case is a written folder that would be wrong; each must fail with nothing left
at the destination. The same conversion without the breakage passes (the bundled one in test_convert.py; the
remote-code case below)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import hf_qknorm
import hf_qknorm.conversion.orchestration.converter as converter
import hf_qknorm.conversion.output.writing as writing
from hf_qknorm import QKNormConfig
from hf_qknorm.conversion.orchestration.checks import ConversionCheckError, check_report_finite
from hf_qknorm.modeling import remote
from tests._support.convert_support import (
    SHORT_TEXT,
    SMALL,
    bundled_copy,
    hook_source_skipping_the_norm,
    leftovers,
    quiet,
    save_source,
)


def _no_output(tmp_path, dst) -> None:
    assert not dst.exists() and leftovers(tmp_path) == []


@pytest.mark.spawns
def test_remote_code_that_skips_the_norm_fails_the_conversion(tmp_path, monkeypatch):
    """The folder's shipped hook edited to skip the norm: the plugin computes the right thing, a user without it
    would not. Only verify="full" (the remote code in a process without hf_qknorm) can see it."""
    save_source(tmp_path / "src", "llama")
    real = remote.remote_files
    ok = hf_qknorm.convert(
        tmp_path / "src",
        tmp_path / "ok",
        config=QKNormConfig(scheme="qk_norm_cap"),
        calibrate=False,
        progress=False,
        log=quiet,
    )  # unbroken: passes the full verification
    assert (ok.path / "model.safetensors").is_file()

    def edited(*args):
        files = real(*args)
        files["qknorm_hooks.py"] = hook_source_skipping_the_norm(files["qknorm_hooks.py"])
        return files

    monkeypatch.setattr(remote, "remote_files", edited)
    messages = []
    dst = tmp_path / "out"
    with pytest.raises(
        ConversionCheckError,
        match=r"failed verification \(without hf_qknorm, through its remote "
        r"code\): norms DROPPED.*nothing was written",
    ):
        hf_qknorm.convert(
            tmp_path / "src",
            dst,
            config=QKNormConfig(scheme="qk_norm_cap"),
            calibrate=False,
            progress=False,
            log=messages.append,
        )
    _no_output(tmp_path, dst)
    assert any("FAILED" in m for m in messages)  # the verifier's table is logged
    hf_qknorm.convert(
        tmp_path / "src",
        dst,
        config=QKNormConfig(scheme="qk_norm_cap"),
        calibrate=False,
        progress=False,
        log=quiet,
        verify="plugin",
    )  # the plugin alone cannot see what the shipped code does
    assert dst.is_dir()


@pytest.mark.parametrize("layer", [0, 3])
def test_a_dropped_norm_weight_fails_the_conversion(tmp_path, monkeypatch, layer):
    """A writer that loses one norm tensor (in a verified layer, or in one the verifier's view does not load)."""
    from safetensors.torch import load_file, save_file

    save_source(tmp_path / "src", "llama", num_hidden_layers=4)
    real = writing.write_weights
    key = f"model.layers.{layer}.self_attn.k_norm.weight"

    def lossy(weights, plan, out, progress=True):
        files = real(weights, plan, out, progress)
        tensors = load_file(out / "model.safetensors")
        del tensors[key]
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return files

    monkeypatch.setattr(writing, "write_weights", lossy)
    dst = tmp_path / "out"
    with pytest.raises(ConversionCheckError, match=f"written weights.*{key} is missing.*nothing was written"):
        hf_qknorm.convert(
            tmp_path / "src", dst, config=QKNormConfig(scheme="qk_norm"), calibrate=False, progress=False, log=quiet
        )
    _no_output(tmp_path, dst)


def test_a_config_that_lost_its_cap_fails_the_conversion(tmp_path, monkeypatch):
    import hf_qknorm.conversion.output.export as export

    save_source(tmp_path / "src", "llama")
    real = export.write_config

    def wrong_cap(folder, kind, patched_config, dtype, *rest):
        out = real(folder, kind, patched_config, dtype, *rest)
        data = json.loads((folder / "config.json").read_text())
        data["qknorm"]["softcap"] = 1e6  # a cap so large it never acts
        (folder / "config.json").write_text(json.dumps(data))
        return out

    monkeypatch.setattr(export, "write_config", wrong_cap)
    dst = tmp_path / "out"
    with pytest.raises(ConversionCheckError, match="loads as QKNormLlamaForCausalLM with scheme .*1000000.*not "):
        hf_qknorm.convert(
            tmp_path / "src",
            dst,
            config=QKNormConfig(scheme="qk_norm_cap"),
            calibrate=False,
            progress=False,
            log=quiet,
            verify="plugin",
        )
    _no_output(tmp_path, dst)


def test_a_source_that_computes_nan_fails_the_conversion(tmp_path):
    """A model whose logits are NaN must not give a NaN report and exit 0. An inf weight in the source is refused
    where it is read, naming it (issue 22); a finite weight so large that the source computes inf gives a non-finite
    report, and the conversion must fail before writing."""
    from transformers import AutoModelForCausalLM

    src = bundled_copy(tmp_path / "src")
    model = AutoModelForCausalLM.from_pretrained(src)
    dst = tmp_path / "out"
    for value, error, match in (
        (
            float("inf"),
            ValueError,
            r"source tensor model\.layers\.1\.mlp\.down_proj\.weight in model\.safetensors "
            r"has 0 NaN and 512 infinite value\(s\)",
        ),
        (
            3e38,
            ConversionCheckError,
            r"report is not finite \(original perplexity (nan|inf).*source model itself.*"
            r"nothing was written",
        ),
    ):
        with torch.no_grad():
            model.model.layers[1].mlp.down_proj.weight[0, :] = value
        model.save_pretrained(src)
        with pytest.raises(error, match=match):
            hf_qknorm.convert(src, dst, calibration=SMALL, calibration_text=SHORT_TEXT, progress=False, log=quiet)
        _no_output(tmp_path, dst)


def test_a_converted_model_that_computes_nan_fails_the_conversion(tmp_path, monkeypatch):
    """The converted side going non-finite (what softcap=1e39 did before caps were bounded): fail, write nothing."""
    real = converter._calibrated

    def nan_after_conversion(*args, **kwargs):
        config, values, report = real(*args, **kwargs)
        report.ppl_calibrated = float("nan")
        return config, values, report

    monkeypatch.setattr(converter, "_calibrated", nan_after_conversion)
    dst = tmp_path / "out"
    with pytest.raises(ConversionCheckError, match="calibrated perplexity nan.*converted model computes non-finite"):
        hf_qknorm.convert(None, dst, calibration=SMALL, calibration_text=SHORT_TEXT, progress=False, log=quiet)
    _no_output(tmp_path, dst)


def test_report_checks_every_number():
    from hf_qknorm.conversion.calibration.calibrate import CalibrationReport, LayerStats

    def report(**changes):
        base = dict(
            scheme={},
            ppl_original=10.0,
            ppl_identity=30.0,
            ppl_least_squares=12.0,
            ppl_calibrated=10.5,
            calibration_tokens=1000,
            eval_tokens=500,
            steps=5,
            kl_start=0.2,
            kl_end=0.01,
            seconds=1.0,
            layers=[LayerStats(0, [1.0], [1.0], [0.5], 40.0, 30.0)],
            cap=50.0,
        )
        return CalibrationReport(**{**base, **changes})

    check_report_finite(report())
    check_report_finite(report(kl_start=None, kl_end=None))  # soft_cap: no distillation
    for field in ("ppl_identity", "ppl_least_squares", "kl_end"):
        with pytest.raises(ConversionCheckError, match="not finite"):
            check_report_finite(report(**{field: math.inf}))
    with pytest.raises(ConversionCheckError, match="layer 0 max logit .converted. nan"):
        check_report_finite(report(layers=[LayerStats(0, [1.0], [1.0], [0.5], 40.0, math.nan)]))


def test_verify_mode_is_checked_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(converter, "inspect_source", lambda *a: pytest.fail("the source was read"))
    with pytest.raises(ValueError, match="unknown verify mode 'maybe'"):
        hf_qknorm.convert(None, tmp_path / "o", verify="maybe", log=quiet)

"""``benchmarks/heal_attribution.py``: which converted attention layers cost the answers.

What is checked against something the script did not compute: putting every converted layer into the original
gives the converted model itself (same embeddings, MLPs and head), so the last ``upto`` row must equal the whole
converted model's figures, and the first ``upto`` row is the first ``single`` one; a folder that is not a model is
refused in one line."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import hf_qknorm
from hf_qknorm import QKNormConfig
from hf_qknorm.conversion.calibration.calibrate import CalibrationSettings
from tests._support.convert_support import SHORT_TEXT, bundled_copy, quiet

ROOT = Path(__file__).resolve().parents[2]
FAST = CalibrationSettings(block_len=64, calibration_blocks=4, eval_blocks=2, local_steps=5, agreement_tokens=0)


def _script():
    spec = importlib.util.spec_from_file_location("heal_attribution", ROOT / "benchmarks" / "heal_attribution.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_layer_swapped_is_the_converted_model(tmp_path, capsys):
    src = bundled_copy(tmp_path / "src")
    out = hf_qknorm.convert(
        src,
        tmp_path / "out",
        config=QKNormConfig(scheme="qk_norm_cap", norm="rmsnorm", softcap=5.0),  # a cap that bites: the answers move
        calibration=FAST,
        calibration_text=SHORT_TEXT,
        progress=False,
        log=quiet,
        verify="plugin",
    )
    results = tmp_path / "rows.jsonl"
    args = ["--src", str(src), "--converted", str(out.path), "--new-tokens", "4", "--results", str(results)]
    assert _script().main(args) == 0
    (row,) = [json.loads(line) for line in results.read_text().splitlines()]
    layers = len(row["single"])
    assert layers == len(row["upto"]) > 1
    assert row["whole"]["kl"] > 1e-4  # the conversion moved the answers, so the checks below can fail
    assert row["upto"][-1]["kl"] == pytest.approx(row["whole"]["kl"], rel=1e-4, abs=1e-7)
    assert row["upto"][-1]["top1"] == row["whole"]["top1"] and row["upto"][-1]["prefix"] == row["whole"]["prefix"]
    assert row["upto"][0] == row["single"][0]
    assert all(s["kl"] >= 0 for s in row["single"]) and row["conversion"]["scheme"] == "qk_norm_cap"
    assert "converted: KL" in capsys.readouterr().out


def test_a_folder_that_is_not_a_model_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        _script().main(["--src", str(tmp_path), "--converted", str(tmp_path), "--no-save"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a model folder (no config.json)" in err

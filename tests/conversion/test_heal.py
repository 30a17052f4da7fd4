"""Healing (issue 31): after calibration, each converted attention layer is distilled from the original's.

Tiny models, a few Adam steps: CI time. What is checked against something the healing code did not compute: the
written folder's own perplexity (``hf_qknorm.data.perplexity`` on the loaded model) against the report, the source's
tensors against the written ones, plain Qwen3 loading of a qk_norm/rmsnorm Llama, and the command line's errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import hf_qknorm
from hf_qknorm import QKNormConfig
from hf_qknorm.cli.main import main
from hf_qknorm.conversion.calibrate import CalibrationSettings
from hf_qknorm.conversion.heal import HealSettings
from hf_qknorm.conversion.texts import text_blocks
from hf_qknorm.data import split_text
from tests._support.convert_support import SHORT_TEXT, bundled_copy, leftovers, quiet, save_source, tree_hash

FAST = CalibrationSettings(block_len=64, calibration_blocks=8, eval_blocks=4, local_steps=10, agreement_tokens=0)
HEAL = HealSettings(tokens=64 * 30, blocks=8, lr=1e-3)  # 30 steps per layer


def _convert(src, dst, scheme="qk_norm", norm="rmsnorm", heal=HEAL, **kwargs):
    return hf_qknorm.convert(
        src,
        dst,
        config=QKNormConfig(scheme=scheme, norm=norm),
        calibration=FAST,
        heal=heal,
        calibration_text=SHORT_TEXT,
        progress=False,
        log=quiet,
        verify="plugin",
        **kwargs,
    )


def test_healed_llama_is_still_qwen3_closer_to_the_original_and_recorded(tmp_path):
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    src = bundled_copy(tmp_path / "src")
    before = tree_hash(src)
    result = _convert(src, tmp_path / "out")
    assert tree_hash(src) == before  # the source was only read
    assert result.export == "qwen3"
    h = result.report.heal
    # the written folder, loaded as a plain Qwen3 model, has the perplexity the report gives it
    model = Qwen3ForCausalLM.from_pretrained(result.path).eval()
    blocks = text_blocks(
        split_text(SHORT_TEXT, 0.1)[1], AutoTokenizer.from_pretrained(src), 64, FAST.eval_blocks, "held-out"
    )
    assert hf_qknorm.data.perplexity(model, blocks) == pytest.approx(h["ppl_after"], rel=1e-4)
    assert h["ppl_before"] == pytest.approx(result.report.ppl_calibrated, rel=1e-4)  # the same held-out text
    assert h["ppl_after"] < h["ppl_before"] and h["top1_after"] >= h["top1_before"]
    assert h["steps_per_layer"] == 30 and h["tokens_per_layer"] == 30 * 64 and h["text_tokens"] == 8 * 64
    # the projections changed (healing trains them), embeddings and MLPs did not
    old, new = load_file(src / "model.safetensors"), load_file(result.path / "model.safetensors")
    assert not torch.equal(old["model.layers.0.self_attn.q_proj.weight"], new["model.layers.0.self_attn.q_proj.weight"])
    for key in ("model.embed_tokens.weight", "model.layers.1.mlp.up_proj.weight", "model.norm.weight"):
        assert torch.equal(old[key], new[key])
    # recorded in qknorm_conversion.json and the model card
    record = json.loads((result.path / "qknorm_conversion.json").read_text())
    assert record["heal"]["settings"] == {"tokens": 1920, "blocks": 8, "lr": 1e-3, "seed": 0, "inputs": "original"}
    assert record["heal"]["ppl_after"] == h["ppl_after"] and record["heal"]["seconds"] > 0
    card = (result.path / "README.md").read_text()
    assert "Healed:" in card and f"{h['ppl_after']:.3f}" in card
    assert "healed: 30 steps per layer" in result.report.summary()


def test_without_heal_conversion_is_as_before(tmp_path):
    src = bundled_copy(tmp_path / "src")
    result = _convert(src, tmp_path / "out", heal=None)
    assert result.report.heal is None
    assert json.loads((result.path / "qknorm_conversion.json").read_text())["heal"] is None
    assert "Healed" not in (result.path / "README.md").read_text()
    old, new = load_file(src / "model.safetensors"), load_file(result.path / "model.safetensors")
    assert all(torch.equal(old[k], new[k]) for k in old)  # only norms are added; nothing else changes


@pytest.mark.parametrize("inputs", ["original", "converted"])
def test_healed_qkv_norm_writes_what_it_measured(tmp_path, inputs):
    """qkv_norm folds the removed pre-norm into the projections: the healed projections are written as trained
    (not folded a second time), so the loaded folder computes the report's perplexity -- fitted on the original's
    activations or on the healed model's own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = bundled_copy(tmp_path / "src")
    heal = HealSettings(tokens=64 * 30, blocks=8, lr=1e-3, inputs=inputs)
    result = _convert(src, tmp_path / "out", scheme="qkv_norm", norm="layernorm", heal=heal)
    model = AutoModelForCausalLM.from_pretrained(result.path).eval()
    blocks = text_blocks(
        split_text(SHORT_TEXT, 0.1)[1], AutoTokenizer.from_pretrained(src), 64, FAST.eval_blocks, "held-out"
    )
    assert hf_qknorm.data.perplexity(model, blocks) == pytest.approx(result.report.heal["ppl_after"], rel=1e-4)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"tokens": 0}, "heal tokens must be an integer >= 1, got 0"),
        ({"blocks": -2}, "heal blocks must be an integer >= 1, got -2"),
        ({"lr": float("nan")}, "heal lr must be a positive finite number, got nan"),
        ({"inputs": "teacher"}, "heal inputs must be 'original' or 'converted', got 'teacher'"),
    ],
)
def test_bad_heal_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        HealSettings(**settings)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--heal-tokens", "0"], "error: heal tokens must be an integer >= 1, got 0"),
        (["--heal-tokens", "lots"], "--heal-tokens: invalid int value: 'lots'"),
        (["--heal", "--no-calibration"], "error: healing starts from the calibrated model"),
        (["--heal-inputs", "mine"], "error: heal inputs must be 'original' or 'converted', got 'mine'"),
    ],
)
def test_command_line_refuses_bad_heal_input_in_one_line(tmp_path, capsys, argv, message):
    src = tmp_path / "src"
    save_source(src, "llama")
    code = 2
    try:
        code = main(["convert", str(src), str(tmp_path / "out"), "--quiet", *argv])
    except SystemExit as exc:  # argparse's own type errors
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len([line for line in err if line.startswith(("error", "hf-qknorm"))]) == 1
    assert message in err[-1] and "Traceback" not in "\n".join(err)
    assert not (tmp_path / "out").exists()


def test_interrupted_heal_leaves_nothing(tmp_path, capsys, monkeypatch):
    import hf_qknorm.conversion.heal as heal

    src = bundled_copy(tmp_path / "src")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(heal, "_fit", interrupted)
    code = main(
        ["convert", str(src), str(tmp_path / "out"), "--quiet", "--heal", "--block-len", "64"]
        + ["--calibration-blocks", "4", "--eval-blocks", "2", "--local-steps", "2", "--agreement-tokens", "0"]
    )
    err = capsys.readouterr().err
    assert code == 130 and "interrupted" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []

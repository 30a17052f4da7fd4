"""Healing (issue 31): after calibration, each converted attention layer is distilled from the original's.

Tiny models, a few Adam steps: CI time. What is checked against something the healing code did not compute: the
written folder's own perplexity (``hf_qknorm.data.perplexity`` on the loaded model) against the report, the source's
tensors against the written ones, plain Qwen3 loading of a qk_norm/rmsnorm Llama, and the command line's errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

import hf_qknorm
from hf_qknorm import QKNormConfig
from hf_qknorm.cli.main import main
from hf_qknorm.conversion.calibration.calibrate import CalibrationSettings
from hf_qknorm.conversion.healing.heal import SELF_NEW_TOKENS, HealSettings
from hf_qknorm.conversion.orchestration.texts import text_blocks
from hf_qknorm.data import split_text
from tests._support.convert_support import SHORT_TEXT, bundled_copy, leftovers, quiet, save_source, tree_hash

FAST = CalibrationSettings(block_len=64, calibration_blocks=8, eval_blocks=4, local_steps=10, agreement_tokens=0)
HEAL = HealSettings(tokens=64 * 30, blocks=8, lr=1e-3, text="calibration")  # 30 steps per layer


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
    assert record["heal"]["settings"] == {
        "tokens": 1920,
        "blocks": 8,
        "lr": 1e-3,
        "lr_search": True,
        "seed": 0,
        "text": "calibration",
        "mix": "apart",
        "self_tokens": 32_768,
        "inputs": "original",
        "attention_kl": 1.0,
        "end_to_end_tokens": 0,
        "end_to_end_lr": 1e-4,
    }
    assert record["heal"]["generated_tokens"] == 0
    # every layer's step size is one of the candidates the search may try (the grid, two smaller)
    assert len(record["heal"]["layer_lrs"]) == len(record["heal"]["layer_errors"])
    assert {round(lr, 12) for lr in record["heal"]["layer_lrs"]} <= {1e-3, 3e-4, 1e-4, 3e-5, 1e-5}
    assert record["heal"]["end_to_end"] is None
    assert record["heal"]["ppl_after"] == h["ppl_after"] and record["heal"]["seconds"] > 0
    card = (result.path / "README.md").read_text()
    assert "Healed:" in card and f"{h['ppl_after']:.3f}" in card
    assert "attention probabilities (KL divergence, weight 1.0)" in card
    assert "healed: 30 steps per layer" in result.report.summary()


def test_lr_search_takes_the_step_size_whose_trial_fits_best(tmp_path, monkeypatch):
    """A step size far too large for the weights (30) ruins every layer's fit, which is then not kept; with the
    search the same setting tries 30 and 30 x 1e-4 on short fits and heals every layer with the smaller."""
    from hf_qknorm.conversion.healing import heal as heal_module

    monkeypatch.setattr(heal_module, "LR_FACTORS", (1.0, 1e-4))
    monkeypatch.setattr(heal_module, "LR_WIDEN", 0)  # the two steps alone
    monkeypatch.setattr(heal_module, "TRIAL_SHARE", 3)  # 10 trial steps of the 30
    src = bundled_copy(tmp_path / "src")
    fixed = _convert(src, tmp_path / "fixed", heal=dataclasses.replace(HEAL, lr=30.0, lr_search=False)).report.heal
    searched = _convert(src, tmp_path / "searched", heal=dataclasses.replace(HEAL, lr=30.0)).report.heal
    layers = len(fixed["layer_errors"])
    assert fixed["layer_lrs"] == [30.0] * layers and fixed["layers_kept"] < layers
    assert searched["layer_lrs"] == [pytest.approx(3e-3)] * layers and searched["layers_kept"] == layers


@pytest.mark.parametrize(
    "best, tried, picked",
    [
        (2e-4, [1e-3, 3e-4, 1e-4], 3e-4),  # inside the grid: three trials
        (3e-5, [1e-3, 3e-4, 1e-4, 3e-5, 1e-5], 3e-5),  # below it: two more, the second worse
        (1e-7, [1e-3, 3e-4, 1e-4, 3e-5, 1e-5], 1e-5),  # far below it: two more at most
        (1e-1, [1e-3, 3e-4, 1e-4], 1e-3),  # above it: a short trial favours large steps, so never beyond the grid
        (None, [1e-3, 3e-4, 1e-4, 3e-5, 1e-5], 1e-3),  # every trial diverges: smaller steps, then --heal-lr
    ],
)
def test_lr_search_tries_smaller_steps_while_the_smallest_fits_best(monkeypatch, best, tried, picked):
    """Where the grid's smallest step size fits best, the search tries the next smaller of the 1-3-10 series (Gemma 3
    at cap 10 takes 1e-4, the smallest, in 16 of 18 layers; 3e-5 then lowered layer 1's output error by a third), at
    most LR_WIDEN more; a trial's error here is the distance of its step from ``best`` in decades."""
    import math

    from hf_qknorm.conversion.healing import heal as heal_module

    seen = []
    monkeypatch.setattr(heal_module, "fit_output", lambda *args, **kwargs: seen.append(args[7]))
    errors = (lambda lr: abs(math.log10(lr / best))) if best else (lambda lr: math.nan)
    monkeypatch.setattr(heal_module, "relative_error", lambda *args: errors(seen[-1]))
    monkeypatch.setattr(heal_module, "_restore", lambda params, start: None)
    settings = HealSettings(tokens=64 * 32, lr=1e-3)
    got = heal_module._pick_lr(None, [None] * 4, [None] * 4, 1.0, {}, {}, settings, 64, 0, None, [])
    assert seen == pytest.approx(tried) and got == pytest.approx(picked)


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
    heal = HealSettings(tokens=64 * 30, blocks=8, lr=1e-3, inputs=inputs, text="calibration")
    result = _convert(src, tmp_path / "out", scheme="qkv_norm", norm="layernorm", heal=heal)
    model = AutoModelForCausalLM.from_pretrained(result.path).eval()
    blocks = text_blocks(
        split_text(SHORT_TEXT, 0.1)[1], AutoTokenizer.from_pretrained(src), 64, FAST.eval_blocks, "held-out"
    )
    assert hf_qknorm.data.perplexity(model, blocks) == pytest.approx(result.report.heal["ppl_after"], rel=1e-4)
    # the attention term left to its default is qkv_norm's, none; the report and the card say so
    assert heal.attention_kl is None and result.report.heal["settings"]["attention_kl"] == 0.0
    assert "output error alone (no attention term)" in result.report.summary()
    assert "(output error alone, no attention\nterm)" in (result.path / "README.md").read_text()


@pytest.mark.parametrize(
    "scheme, given, used",
    [
        ("qk_norm", None, 1.0),
        ("qk_norm_cap", None, 1.0),
        ("soft_cap", None, 1.0),
        ("qkv_norm", None, 0.0),  # measured: the term cost SmolLM2's qkv_norm three points of perplexity
        ("qkv_norm", 2.0, 2.0),  # a weight given is used as given, on every scheme
        ("qk_norm", 0.0, 0.0),
    ],
)
def test_the_attention_terms_default_is_the_schemes(scheme, given, used):
    settings = HealSettings(attention_kl=given)
    assert settings.for_scheme(scheme).attention_kl == used
    assert settings.attention_kl == given  # resolving returns new settings


@pytest.mark.parametrize(
    "scheme, given, used",
    [
        ("qk_norm", None, "apart"),
        ("qk_norm_cap", None, "apart"),
        ("qkv_norm", None, "apart"),  # measured: with answers of 128 tokens qkv_norm heals better apart too
        ("qkv_norm", "apart", "apart"),  # a mix given is used as given, on every scheme
        ("qk_norm", "interleaved", "interleaved"),
    ],
)
def test_the_mix_default_is_the_schemes(scheme, given, used):
    settings = HealSettings(mix=given)
    assert settings.for_scheme(scheme).mix == used
    assert settings.mix == given


@pytest.mark.parametrize(
    "scheme, given, used",
    [
        ("qk_norm", None, 204_800),
        ("qk_norm_cap", None, 204_800),
        ("soft_cap", None, 204_800),
        ("qkv_norm", None, 384_000),  # measured: nearly twice the steps take qkv_norm's Shakespeare within 1.15x
        ("qkv_norm", 1024, 1024),  # a count given is used as given, on every scheme
        ("qk_norm", 409_600, 409_600),
    ],
)
def test_the_heal_tokens_default_is_the_schemes(scheme, given, used):
    settings = HealSettings(tokens=given)
    resolved = settings.for_scheme(scheme)
    assert resolved.tokens == used
    assert resolved.steps(256) == used // 256
    assert settings.tokens == given


@pytest.mark.parametrize(
    "tokens, search, trial",
    [
        (204_800, True, 50),  # 800 steps: a sixteenth
        (384_000, True, 50),  # 1500 steps: trials as long as the default count's, not a sixteenth of the longer fit
        (102_400, True, 25),
        (256, True, 1),
        (204_800, False, 0),
    ],
)
def test_trials_rank_step_sizes_on_at_most_the_default_counts_sixteenth(tokens, search, trial):
    settings = HealSettings(tokens=tokens, lr_search=search)
    assert settings.trial_steps(256) == trial
    assert settings.layer_steps(256) == tokens // 256 + 3 * trial


def test_layer_errors_are_measured_on_calls_spread_over_the_recorded_ones():
    from hf_qknorm.conversion.healing.heal import ERROR_CALLS, _spread

    calls, targets = list(range(256)), [f"t{j}" for j in range(256)]
    picked, their = _spread(calls, targets, ERROR_CALLS)
    assert picked == list(range(0, 256, 4)) and their == [f"t{j}" for j in picked]  # 64 spread, targets aligned
    assert _spread(calls[:10], targets[:10], ERROR_CALLS) == (calls[:10], targets[:10])  # few: all of them
    spread = _spread(calls[:100], targets[:100], ERROR_CALLS)[0]
    assert len(set(spread)) == 64 and spread[0] == 0 and spread[-1] >= 98  # over all of them, none twice


def test_heal_steps_refuse_tokens_not_resolved_for_a_scheme():
    """Steps are counted from what ``convert`` resolved: tokens left to ``None`` are refused, not guessed."""
    with pytest.raises(ValueError, match=r"tokens is None; pass settings.for_scheme\(scheme\)"):
        HealSettings().steps(256)


def test_heal_text_refuses_a_mix_not_resolved_for_a_scheme(tmp_path):
    """``heal_text`` is given what ``convert`` resolved: left to ``None`` the mix is refused, not guessed."""
    from hf_qknorm.conversion.healing.heal import heal_text

    with pytest.raises(ValueError, match=r"settings.mix is None; pass settings.for_scheme\(scheme\)"):
        heal_text(tmp_path, None, "text", HealSettings(), torch.device("cpu"), progress=False)


def test_heal_checkpoint_refuses_settings_not_resolved_for_a_scheme():
    """``heal_checkpoint`` is given what ``convert`` resolved; left to ``None`` the term would silently be off."""
    from hf_qknorm.conversion.healing.heal import heal_checkpoint

    with pytest.raises(ValueError, match=r"settings.attention_kl is None; pass settings.for_scheme\(scheme\)"):
        heal_checkpoint(None, {}, None, None, HealSettings(), 1)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"tokens": 0}, "heal tokens must be an integer >= 1, got 0"),
        ({"blocks": -2}, "heal blocks must be an integer >= 1, got -2"),
        ({"lr": float("nan")}, "heal lr must be a positive finite number, got nan"),
        ({"inputs": "teacher"}, "heal inputs must be 'original' or 'converted', got 'teacher'"),
        ({"tokens": 2.5}, "heal tokens must be an integer >= 1, got 2.5"),
        ({"tokens": True}, "heal tokens must be an integer >= 1, got True"),
        ({"end_to_end_tokens": -1}, "heal end to end tokens must be an integer >= 0, got -1"),
        ({"end_to_end_tokens": 2.5}, "heal end to end tokens must be an integer >= 0, got 2.5"),
        ({"end_to_end_lr": 0}, "heal end to end lr must be a positive finite number, got 0"),
        ({"end_to_end_lr": True}, "heal end to end lr must be a positive finite number, got True"),
        ({"text": "wiki"}, "heal text must be 'self' or 'calibration', got 'wiki'"),
        ({"self_tokens": 0}, "heal self tokens must be an integer >= 1, got 0"),
        ({"lr_search": "yes"}, "heal lr search must be True or False, got 'yes'"),
        ({"attention_kl": -0.5}, "heal attention kl must be a finite number >= 0, got -0.5"),
        ({"attention_kl": float("inf")}, "heal attention kl must be a finite number >= 0, got inf"),
        ({"attention_kl": True}, "heal attention kl must be a finite number >= 0, got True"),
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
        (["--heal-end-to-end-tokens", "-5"], "error: heal end to end tokens must be an integer >= 0, got -5"),
        (["--heal-text", "mine"], "error: heal text must be 'self' or 'calibration', got 'mine'"),
        (["--heal-attention-kl", "-1"], "error: heal attention kl must be a finite number >= 0, got -1.0"),
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
    import hf_qknorm.conversion.healing.heal as heal

    src = bundled_copy(tmp_path / "src")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(heal, "_fit", interrupted)
    code = main(
        ["convert", str(src), str(tmp_path / "out"), "--quiet", "--heal", "--block-len", "64", "--heal-text"]
        + ["calibration", "--calibration-blocks", "4", "--eval-blocks", "2", "--local-steps", "2"]
        + ["--agreement-tokens", "0"]
    )
    err = capsys.readouterr().err
    assert code == 130 and "interrupted" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


# --------------------------------------------------------------------------------------------------------------------
# the end-to-end stage
# --------------------------------------------------------------------------------------------------------------------
E2E = HealSettings(tokens=64 * 10, blocks=8, lr=1e-3, end_to_end_tokens=64 * 20, end_to_end_lr=3e-4, text="calibration")


def _kl_of_folders(src, converted, blocks) -> float:
    """KL (nats per token) from the source's next-token distribution to a written folder's, computed here."""
    from torch.nn import functional as F
    from transformers import AutoModelForCausalLM

    p_model = AutoModelForCausalLM.from_pretrained(src).eval()
    q_model = AutoModelForCausalLM.from_pretrained(converted).eval()
    with torch.no_grad():
        p = F.log_softmax(p_model(input_ids=blocks).logits.float(), dim=-1)
        q = F.log_softmax(q_model(input_ids=blocks).logits.float(), dim=-1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


def test_end_to_end_stage_lowers_the_kl_it_reports_and_writes_its_model(tmp_path):
    """After the layer-wise stage, every attention layer trained at once on the KL from the original: the written
    folder (still a plain Qwen3 folder) has the KL and perplexity the report gives, computed here from the folders."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    src = bundled_copy(tmp_path / "src")
    before = tree_hash(src)
    layerwise = _convert(src, tmp_path / "layerwise", heal=dataclasses.replace(E2E, end_to_end_tokens=0))
    result = _convert(src, tmp_path / "out", heal=E2E)
    assert tree_hash(src) == before and result.export == "qwen3"
    h, e = result.report.heal, result.report.heal["end_to_end"]
    assert e["kept"] and e["kl_after"] < e["kl_before"] and e["steps"] == 20 and e["tokens"] == 20 * 64
    tokenizer = AutoTokenizer.from_pretrained(src)
    calibration, held_out = split_text(SHORT_TEXT, 0.1)
    monitor = text_blocks(calibration, tokenizer, 64, E2E.blocks, "heal text")[:4]
    assert _kl_of_folders(src, layerwise.path, monitor) == pytest.approx(e["kl_before"], rel=1e-3)
    assert _kl_of_folders(src, result.path, monitor) == pytest.approx(e["kl_after"], rel=1e-3)
    blocks = text_blocks(held_out, tokenizer, 64, FAST.eval_blocks, "held-out")
    model = Qwen3ForCausalLM.from_pretrained(result.path).eval()
    assert hf_qknorm.data.perplexity(model, blocks) == pytest.approx(h["ppl_after"], rel=1e-4)
    assert e["ppl_before"] == pytest.approx(layerwise.report.heal["ppl_after"], rel=1e-4)
    # every layer's attention moved again; the MLPs and embeddings are the source's
    old, mid, new = (load_file(p / "model.safetensors") for p in (src, layerwise.path, result.path))
    for i in range(model.config.num_hidden_layers):
        key = f"model.layers.{i}.self_attn.o_proj.weight"
        assert not torch.equal(mid[key], new[key])
    for key in ("model.embed_tokens.weight", "model.layers.1.mlp.up_proj.weight", "model.norm.weight"):
        assert torch.equal(old[key], new[key])
    record = json.loads((result.path / "qknorm_conversion.json").read_text())
    assert record["heal"]["end_to_end"] == e and record["heal"]["settings"]["end_to_end_tokens"] == 64 * 20
    assert "end-to-end KL distillation" in (result.path / "README.md").read_text()
    assert "end-to-end: 20 steps" in result.report.summary()


def test_an_end_to_end_stage_that_raises_the_kl_is_not_kept(tmp_path):
    """A step size that makes things worse: the layer-wise weights are written, and the report says so."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = bundled_copy(tmp_path / "src")
    heal = dataclasses.replace(E2E, end_to_end_tokens=64 * 5, end_to_end_lr=5.0)
    result = _convert(src, tmp_path / "out", heal=heal)
    h, e = result.report.heal, result.report.heal["end_to_end"]
    assert not e["kept"] and e["kl_after"] >= e["kl_before"]
    assert h["ppl_after"] == pytest.approx(e["ppl_before"], rel=1e-4)
    blocks = text_blocks(
        split_text(SHORT_TEXT, 0.1)[1], AutoTokenizer.from_pretrained(src), 64, FAST.eval_blocks, "held-out"
    )
    model = AutoModelForCausalLM.from_pretrained(result.path).eval()
    assert hf_qknorm.data.perplexity(model, blocks) == pytest.approx(e["ppl_before"], rel=1e-4)
    assert "not kept" in result.report.summary()


def test_interrupted_end_to_end_stage_leaves_nothing(tmp_path, capsys, monkeypatch):
    import hf_qknorm.conversion.healing.endtoend as endtoend

    src = bundled_copy(tmp_path / "src")
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(endtoend, "_kl", interrupted)  # the stage's first measurement
    code = main(
        ["convert", str(src), str(tmp_path / "out"), "--quiet", "--heal-tokens", "128", "--block-len", "64"]
        + ["--heal-end-to-end-tokens", "128", "--heal-text", "calibration", "--calibration-blocks", "4"]
        + ["--eval-blocks", "2"]
        + ["--local-steps", "2", "--agreement-tokens", "0"]
    )
    err = capsys.readouterr().err
    assert calls and code == 130 and "interrupted" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


# --------------------------------------------------------------------------------------------------------------------
# the heal text: the calibration text mixed with the original's own answers
# --------------------------------------------------------------------------------------------------------------------
SELF = HealSettings(tokens=64 * 10, blocks=8, lr=1e-3, text="self", self_tokens=2 * SELF_NEW_TOKENS)  # two answers


def test_heal_text_self_is_the_calibration_text_mixed_with_the_originals_own_answers(tmp_path):
    """What ``--heal-text self`` fits on, rebuilt here from its parts: the original's sampled answers (the same
    seed, so the same samples) mixed half and half with the calibration text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_qknorm.conversion.healing.heal import heal_text
    from hf_qknorm.conversion.healing.selftext import generation_dtype, mixed_text, self_generated_text

    src = bundled_copy(tmp_path / "src")
    tokenizer = AutoTokenizer.from_pretrained(src)
    calibration = split_text(SHORT_TEXT, 0.1)[0]
    resolved = SELF.for_scheme("qk_norm")
    parts, n_tokens, seconds = heal_text(src, tokenizer, calibration, resolved, torch.device("cpu"), progress=False)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=generation_dtype("cpu")).eval()
    generated = self_generated_text(
        model, tokenizer, calibration, chats=2, openings=0, new_tokens=SELF_NEW_TOKENS, seed=0
    )
    assert parts == ((calibration, 0.5), (generated, 0.5))  # qk_norm's default mix: the two texts apart
    assert n_tokens == len(tokenizer(generated).input_ids) > 2 * SELF_NEW_TOKENS and seconds > 0
    interleaved = dataclasses.replace(SELF, mix="interleaved")
    assert heal_text(src, tokenizer, calibration, interleaved, torch.device("cpu"), progress=False)[0] == (
        (mixed_text(calibration, generated, 0.5), 1.0),
    )
    assert heal_text(src, tokenizer, calibration, HEAL, torch.device("cpu"), progress=False) == (
        ((calibration, 1.0),),
        0,
        0.0,
    )


def _windows_of(block, ids) -> list[int]:
    """Where the token ids of ``block`` (its BOS dropped) occur as a run in ``ids``."""
    body = block[1:].tolist()
    return [i for i in range(len(ids) - len(body) + 1) if ids[i : i + len(body)] == body]


def test_heal_blocks_drawn_apart_come_half_from_each_text_and_none_spans_both(tmp_path):
    """``mix="apart"``: half the blocks are windows of the calibration text alone, half of the answers alone, each
    found whole in its own text's tokens and in neither the other's nor across the join of the two."""
    from transformers import AutoTokenizer

    from hf_qknorm.conversion.orchestration.texts import heal_text_blocks
    from hf_qknorm.data import bundled_text

    tokenizer = AutoTokenizer.from_pretrained(bundled_copy(tmp_path / "src"))
    calibration = bundled_text()[:40_000]
    answers = " ".join(f"Answer {i}: the sky is {['blue', 'grey', 'red'][i % 3]} today, she said." for i in range(600))
    blocks = heal_text_blocks(((calibration, 0.5), (answers, 0.5)), tokenizer, 32, 12, "WikiText")
    assert blocks.shape == (12, 32)
    cal_ids, ans_ids = tokenizer(calibration).input_ids, tokenizer(answers).input_ids
    for i, block in enumerate(blocks):
        own, other = (cal_ids, ans_ids) if i < 6 else (ans_ids, cal_ids)
        assert _windows_of(block, own) and not _windows_of(block, other), i
    mixed = heal_text_blocks(((calibration + answers, 1.0),), tokenizer, 32, 12, "WikiText")
    assert mixed.shape == (12, 32)
    with pytest.raises(ValueError, match="the original's own answers .* too short"):
        heal_text_blocks(((calibration, 0.5), ("Yes.", 0.5)), tokenizer, 32, 12, "WikiText")


@pytest.mark.parametrize(
    ("given", "match"),
    [
        ({"mix": "stacked"}, r"heal mix must be 'interleaved' or 'apart', got 'stacked'"),
        ({"mix": "apart", "blocks": 1}, r"heal blocks must be >= 2, got 1"),
    ],
)
def test_heal_mix_is_checked(given, match):
    with pytest.raises(ValueError, match=match):
        HealSettings(**given)


def test_one_heal_block_needs_one_text():
    """One heal block is refused with the mix ``apart`` (every scheme's default, resolved before any work), naming
    the mix that takes one, and accepted where there is one text to draw from."""
    for scheme in ("qk_norm", "qkv_norm"):
        with pytest.raises(ValueError, match=r"heal blocks must be >= 2, got 1 \(heal mix 'interleaved' draws one\)"):
            HealSettings(blocks=1).for_scheme(scheme)
    assert HealSettings(blocks=1, mix="interleaved").blocks == 1
    assert HealSettings(blocks=1, text="calibration").for_scheme("qk_norm").blocks == 1


def test_healed_on_self_generated_text_writes_what_it_measured_and_says_so(tmp_path):
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    src = bundled_copy(tmp_path / "src")
    before = tree_hash(src)
    result = _convert(src, tmp_path / "out", heal=dataclasses.replace(SELF, mix="apart"))
    assert tree_hash(src) == before
    h = result.report.heal
    assert h["generated_tokens"] > 2 * SELF_NEW_TOKENS and h["generation_seconds"] > 0
    assert h["settings"]["text"] == "self"
    assert h["settings"]["mix"] == "apart" and h["text_tokens"] == SELF.blocks * 64
    blocks = text_blocks(
        split_text(SHORT_TEXT, 0.1)[1], AutoTokenizer.from_pretrained(src), 64, FAST.eval_blocks, "held-out"
    )
    model = Qwen3ForCausalLM.from_pretrained(result.path).eval()
    assert hf_qknorm.data.perplexity(model, blocks) == pytest.approx(h["ppl_after"], rel=1e-4)
    assert "tokens the original generated" in result.report.summary()
    assert "own chat answers and continuations" in (result.path / "README.md").read_text()


def test_interrupted_heal_text_generation_leaves_nothing(tmp_path, capsys, monkeypatch):
    import hf_qknorm.conversion.healing.selftext as selftext

    src = bundled_copy(tmp_path / "src")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(selftext, "self_generated_text", interrupted)
    code = main(
        ["convert", str(src), str(tmp_path / "out"), "--quiet", "--heal", "--block-len", "64"]
        + ["--calibration-blocks", "4", "--eval-blocks", "2", "--local-steps", "2", "--agreement-tokens", "0"]
    )
    err = capsys.readouterr().err
    assert code == 130 and "interrupted" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_the_norms_weights_step_relative_to_their_size():
    """An ``l2``/``lp`` logit scale is a temperature of about 10, calibrated gains reach 2-7: at the projections'
    step size a whole heal moves them a few per cent. A norm weight's step is scaled by its RMS where above 1; the
    q/k/v/o projections and weights of RMS at most 1 keep the step."""
    from hf_qknorm.conversion.calibration.localfit import fit_output
    from hf_qknorm.conversion.calibration.streaming import BlockCall
    from hf_qknorm.conversion.healing.heal import lr_scales
    from tests._support.tiny_models import tiny_model

    cases = (
        ("qk_norm", "l2", None, {"q_norm.weight": 12.5}),
        ("qk_norm", "lp", 4.0, {"q_norm.weight": 12.5}),
        ("qk_norm", "rmsnorm", None, {"q_norm.weight": 3.0, "k_norm.weight": 0.5}),
        ("qkv_norm", "layernorm", None, {"k_norm.weight": 2.0, "v_norm.weight": 1.0, "v_norm.bias": 4.0}),
    )
    for scheme, norm, p, values in cases:
        model = tiny_model("llama")
        hf_qknorm.patch_model(model, QKNormConfig(scheme=scheme, norm=norm, p=p))
        attn = model.model.layers[0].self_attn
        with torch.no_grad():
            for name, value in values.items():
                attn.get_parameter(name).fill_(value)
        params = dict(attn.named_parameters())
        scales = dict(zip(params, lr_scales(attn, params), strict=True))
        want = {k: v for k, v in values.items() if k.endswith("weight") and v > 1}  # a bias keeps the step
        assert {k: s for k, s in scales.items() if s != 1.0} == pytest.approx(want), (scheme, norm)

    class Scale(torch.nn.Module):  # output g * x: the target needs g from 10 to 15
        def __init__(self):
            super().__init__()
            self.g = torch.nn.Parameter(torch.tensor([10.0]))

        def forward(self, x):
            return self.g * x

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    calls, targets = [BlockCall((x,), {}, True)], [15.0 * x]
    moved = {}
    for factors in (None, [10.0]):
        layer = Scale()
        fit_output(layer, calls, targets, 1.0, [layer.g], lambda: None, 100, 1e-3, 0, None, factors)
        moved[factors is not None] = layer.g.detach().item() - 10.0
    assert 0 < moved[False] < 0.1  # Adam moves a parameter about lr per step: 5 stays out of reach
    assert moved[True] > 0.4  # ten times that


def test_the_end_to_end_stage_steps_the_l2_logit_scale_as_the_layer_wise_stage_does(tmp_path, monkeypatch):
    from hf_qknorm.conversion.healing import endtoend

    seen = []
    real = endtoend.cosine_adam
    monkeypatch.setattr(endtoend, "cosine_adam", lambda groups, *a, **k: seen.append(groups) or real(groups, *a, **k))
    result = _convert(bundled_copy(tmp_path / "src"), tmp_path / "out", norm="l2", heal=E2E)
    record = json.loads((result.path / "qknorm_conversion.json").read_text())
    assert record["heal"]["end_to_end"]["steps"] == 20
    (groups,) = seen
    base = [g for g in groups if g["base_lr"] == E2E.end_to_end_lr]
    scaled = [g for g in groups if g["base_lr"] != E2E.end_to_end_lr]
    layers = len(record["heal"]["layer_errors"])
    assert len(base) == 1 and len(base[0]["params"]) >= 4 * layers  # q/k/v/o projections of every layer
    assert sum(len(g["params"]) for g in scaled) == layers  # one logit scale per layer, each stepped by its size
    for group in scaled:
        (scale,) = group["params"]
        assert group["base_lr"] > 1.0 * E2E.end_to_end_lr and scale.numel() == 1


def test_a_buffer_the_checkpoint_stores_is_read_and_kept_across_passes(tmp_path):
    """GLM-4 MoE's router adds a trained ``e_score_correction_bias`` (a persistent buffer, zeros in a fresh model) to
    its scores before choosing experts. The streamed model reads it from the checkpoint as ``from_pretrained`` does
    (the report's original perplexity is the loaded model's), and it stays materialised when a block is released:
    healing passes over the blocks a second time (both failed before: the bias read as zeros, then left on meta)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from hf_qknorm.conversion.orchestration import coverage as conversions

    if "glm4_moe" not in CONFIG_MAPPING_NAMES:
        pytest.skip("GLM-4 MoE is not in this Transformers")
    src = conversions.tiny_source("glm4_moe", tmp_path / "src")
    tensors = load_file(src / "model.safetensors")
    biases = [k for k in tensors if k.endswith("e_score_correction_bias")]
    assert biases and all(torch.count_nonzero(tensors[k]) == 0 for k in biases)  # zeros, as a skeleton's
    gen = torch.Generator().manual_seed(3)
    for k in biases:  # trained: some experts favoured, so the choice of experts differs from a zero bias's
        tensors[k] = torch.randn(tensors[k].shape, generator=gen)
    from safetensors.torch import save_file

    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    result = _convert(src, tmp_path / "out", scheme="qk_norm_cap", norm="layernorm")
    blocks = text_blocks(
        split_text(SHORT_TEXT, 0.1)[1], AutoTokenizer.from_pretrained(src), 64, FAST.eval_blocks, "held-out"
    )
    original = AutoModelForCausalLM.from_pretrained(src).eval()
    assert torch.count_nonzero(original.state_dict()[biases[0]]) > 0
    assert result.report.ppl_original == pytest.approx(hf_qknorm.data.perplexity(original, blocks), rel=1e-4)
    healed = AutoModelForCausalLM.from_pretrained(result.path).eval()
    assert hf_qknorm.data.perplexity(healed, blocks) == pytest.approx(result.report.heal["ppl_after"], rel=1e-4)
    torch.testing.assert_close(load_file(result.path / "model.safetensors")[biases[0]], tensors[biases[0]])

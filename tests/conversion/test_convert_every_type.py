"""hf_qknorm.convert on every kind of model patch_model covers: a tiny checkpoint of each sample type converted with the
main schemes. What is checked comes from the models themselves, never from the converter's own arithmetic:

- the written folder's logits, loaded with the plugin and in a fresh interpreter without it (remote code, or plain
  Transformers for a plain export), equal the converted model in memory: the source loaded by Transformers,
  ``patch_model``-ed, with the norm values the folder holds (so the writer's fold of the pre-norm, its names for
  fused experts and renamed tensors, and the exported code are all checked against patching);
- the report's perplexities are the source model's and the converted model's own (so the streamed, block-by-block
  calibration read every tensor -- fused experts, renamed heads -- and ran every block as the model does);
- a scheme that patching refuses for a model is refused by convert with patching's reason, before any work;
- a qk_norm / rmsnorm conversion of a model with its own RMS q/k norms changes nothing and stays its own type.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from packaging.version import Version
from safetensors import safe_open
from transformers import AutoTokenizer

import hf_qknorm
from hf_qknorm import QKNormConfig, UnsupportedModelError, convert
from hf_qknorm.conversion.calibration.calibrate import new_norm_parameters
from hf_qknorm.conversion.orchestration import coverage as conversions
from hf_qknorm.conversion.orchestration.texts import text_blocks
from hf_qknorm.conversion.output.shards import load_pretrained
from hf_qknorm.data import perplexity, split_text
from tests.modeling.test_coverage import SAMPLE
from tests.modeling.test_export import run_without_plugin

SCHEMES = ("qk_norm", "qk_norm_cap", "qkv_norm")
GAIN_OFFSET = {"gemma3_text": 1.0}  # Gemma 3's own q/k norms multiply by 1 + w (Gemma3RMSNorm)
TEXT = conversions._text()
SETTINGS = conversions.settings()
IDS, MASK = conversions.probe_inputs()


def _quiet(*args, **kwargs):
    pass


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS, attention_mask=MASK).logits.float()


def _in_memory(src, cfg, written: dict) -> torch.nn.Module:
    """The converted model in memory: the source as Transformers loads it, patched, with the folder's norm values."""
    model = load_pretrained(src).eval()
    hf_qknorm.patch_model(model, cfg)
    with torch.no_grad():
        for name, prm in new_norm_parameters(model).items():
            prm.copy_(written[name])
    return model


def _convert_one(tmp, model_type, scheme, norm=None):
    """Convert the tiny ``model_type`` checkpoint with ``scheme``; what the tests look at, or the refusal."""
    src = tmp / model_type / "source"
    if not src.exists():
        conversions.tiny_source(model_type, src)
    cfg = QKNormConfig(scheme, norm=norm)
    out = tmp / model_type / f"{scheme}-{norm}"
    try:
        result = convert(src, out, cfg, SETTINGS, calibration_text=TEXT, verify="plugin", progress=False, log=_quiet)
    except UnsupportedModelError as exc:
        return {"refused": str(exc), "src": src, "cfg": cfg, "out": out}
    loaded = load_pretrained(out).eval()
    held = split_text(TEXT, 0.1)[1]
    blocks = text_blocks(held, AutoTokenizer.from_pretrained(src), SETTINGS.block_len, SETTINGS.eval_blocks, "held")
    row = {"result": result, "src": src, "cfg": cfg, "out": out, "plugin": _logits(loaded), "blocks": blocks}
    if result.export == "qknorm":
        written = {k: p.detach().clone() for k, p in new_norm_parameters(loaded).items()}
    else:  # the model's own norms: their tensors hold the gain in the model's convention
        offset = GAIN_OFFSET.get(model_type, 0.0)
        written = {k: v + offset if k.endswith(".weight") else v for k, v in loaded.state_dict().items()}
    converted = _in_memory(src, cfg, written)
    row["memory"] = _logits(converted)
    row["ppl_converted"] = perplexity(converted, blocks)
    row["ppl_source"] = perplexity(load_pretrained(src).eval(), blocks)
    return row


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Every sample type converted with every main scheme, and every written folder loaded without the plugin in
    one fresh interpreter; (type, scheme) -> what each test looks at (an exception raised is kept, not raised)."""
    tmp = tmp_path_factory.mktemp("every_type")
    rows, jobs = {}, []
    for model_type in SAMPLE:
        if _unbuildable(model_type):
            continue
        for scheme in SCHEMES:
            try:
                rows[model_type, scheme] = row = _convert_one(tmp, model_type, scheme)
            except Exception as exc:  # noqa: BLE001 -- reported by the test of this type
                rows[model_type, scheme] = {"error": exc}
                continue
            if "result" in row:
                key = f"{model_type}/{scheme}"
                remote = row["result"].export == "qknorm"
                jobs.append({"name": key, "path": str(row["out"]), "remote": remote, "ids": IDS.tolist(),
                             "mask": MASK.tolist()})  # fmt: skip
    got = run_without_plugin(tmp, jobs)
    for (model_type, scheme), row in rows.items():
        if "result" in row:
            row["without"] = got[f"{model_type}/{scheme}"]
    return rows


def _unbuildable(model_type: str) -> str | None:
    """Why ``model_type``'s default config cannot be built in this Transformers (5.4's OLMo 2, OLMoE, Falcon-H1: a
    field its own class mistypes), as its coverage table says it; ``None`` where it can."""
    try:
        conversions._default_config(model_type)
    except Exception as exc:  # noqa: BLE001 -- the class's own validation, whatever it raises
        return f"its config cannot be built with defaults ({type(exc).__name__})"
    return None


def _close(got, want, what):
    # row 0 is left-padded: its padded positions are not compared
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4, msg=what)
    torch.testing.assert_close(got[0, conversions.PROBE_PAD :], want[0, conversions.PROBE_PAD :], rtol=1e-4, atol=1e-4,
                               msg=what)  # fmt: skip


@pytest.mark.spawns(shared=True)  # one launch for all its cases, started by the first that runs
@pytest.mark.parametrize("model_type", SAMPLE)
def test_every_sample_type_converts_and_reloads_without_the_plugin(converted, model_type):
    if reason := _unbuildable(model_type):
        pytest.skip(f"{model_type}: {reason} in Transformers {transformers.__version__} (untested in its table too)")
    for scheme in SCHEMES:
        row = converted[model_type, scheme]
        if "error" in row:
            raise row["error"]
        if "refused" in row:  # patching refuses it too, with the same one line
            with pytest.raises(UnsupportedModelError) as patched:
                hf_qknorm.patch_model(load_pretrained(row["src"]), row["cfg"])
            assert row["refused"] == str(patched.value) and model_type in row["refused"]
            assert scheme == "qkv_norm" and not row["out"].exists()
            continue
        result, without = row["result"], row["without"]
        saved = json.loads((row["out"] / "config.json").read_text())
        if result.export == "native":  # Persimmon's own LayerNorm is qk_norm / layernorm: still a Persimmon
            assert (scheme, saved["model_type"]) == ("qk_norm", model_type) and "qknorm" not in saved
            assert not without["module"].startswith("transformers_modules")
        else:
            assert result.export == "qknorm" and saved["model_type"] == f"qknorm_{model_type}"
            assert QKNormConfig.from_dict(saved["qknorm"]) == dataclass_eps(row["cfg"], result.scheme)
            assert without["module"].startswith("transformers_modules")  # the folder's own code, no plugin
        _close(row["plugin"], row["memory"], f"{model_type} {scheme}: with the plugin")
        _close(without["logits"], row["memory"], f"{model_type} {scheme}: without the plugin")
        # the streamed calibration ran the model as Transformers does: the report's perplexities are the models' own
        report = result.report
        assert report.ppl_original == pytest.approx(row["ppl_source"], rel=1e-4)
        assert report.ppl_calibrated == pytest.approx(row["ppl_converted"], rel=1e-4)


def dataclass_eps(asked: QKNormConfig, resolved: QKNormConfig) -> QKNormConfig:
    """The scheme asked for with the epsilon the conversion resolved (the model's own)."""
    import dataclasses

    return dataclasses.replace(asked, eps=resolved.eps)


@pytest.mark.spawns
@pytest.mark.parametrize(
    "model_type, norm", [("gemma3_text", "rmsnorm"), ("qwen3_moe", "rmsnorm"), ("persimmon", "layernorm")]
)
def test_a_model_whose_own_qk_norms_are_the_scheme_converts_to_itself(tmp_path, model_type, norm):
    """Gemma 3's (1 + w), Qwen3-MoE's (w) RMS q/k norms and Persimmon's LayerNorm are qk_norm with that norm: the
    conversion starts from their own gains, changes nothing, and is written as the model's own type."""
    row = _convert_one(tmp_path, model_type, "qk_norm", norm)
    result = row["result"]
    assert result.export == "native"
    source, written = _tensors(row["src"]), _tensors(row["out"])
    assert source.keys() == written.keys() and all(torch.equal(source[k], written[k]) for k in source)
    config = json.loads((row["out"] / "config.json").read_text())
    assert config["model_type"] == model_type and "qknorm" not in config and "auto_map" not in config
    got = run_without_plugin(tmp_path, [{"name": "n", "path": str(row["out"]), "remote": False, "ids": IDS.tolist(),
                                        "mask": MASK.tolist()}])["n"]  # fmt: skip
    plain = load_pretrained(row["src"]).eval()
    assert got["cls"] == type(plain).__name__ and not got["module"].startswith("transformers_modules")
    _close(got["logits"], _logits(plain), f"{model_type}: without the plugin")
    _close(row["plugin"], _logits(plain), f"{model_type}: with the plugin")
    if norm == "rmsnorm":  # patch_model carries a native gain (not a LayerNorm's bias, which it resets)
        patched = hf_qknorm.patch_model(load_pretrained(row["src"]).eval(), row["cfg"])
        _close(_logits(patched), _logits(plain), f"{model_type}: patch_model carries the gains too")


def test_a_refused_scheme_is_refused_before_any_work(tmp_path, monkeypatch):
    """A parallel block (Phi) cannot lose its pre-norm: qkv_norm is refused with patching's reason before the
    calibration text is read or the checkpoint streamed; a model type patching refuses is refused the same way."""
    from hf_qknorm.conversion.calibration import layerwise
    from hf_qknorm.conversion.orchestration import converter

    def never(*args, **kwargs):
        raise AssertionError("work started before the refusal")

    monkeypatch.setattr(layerwise, "calibrate_checkpoint", never)
    monkeypatch.setattr(converter, "read_texts", never)
    for model_type, scheme, words in (("phi", "qkv_norm", "parallel block"), ("llama4_text", "qk_norm", "llama4")):
        src = conversions.tiny_source(model_type, tmp_path / model_type)
        with pytest.raises(UnsupportedModelError) as refused:
            convert(src, tmp_path / f"{model_type}-out", QKNormConfig(scheme), SETTINGS, calibration_text=TEXT,
                    progress=False, log=_quiet)  # fmt: skip
        with pytest.raises(UnsupportedModelError) as patched:
            hf_qknorm.patch_model(load_pretrained(src), scheme)
        assert str(refused.value) == str(patched.value) and words in str(refused.value)
        assert not (tmp_path / f"{model_type}-out").exists()


@pytest.mark.spawns
def test_remote_code_that_skips_the_norm_fails_a_conversion_the_float64_reference_does_not_cover(tmp_path, monkeypatch):
    """For a type the float64 reference in verify does not spell out (here made so: verify refuses Mixtral, whatever
    it covers today), the written folder's logits without the plugin, against the converted model in memory, are
    what catch shipped code that drops the norm (nothing is written)."""
    from hf_qknorm import verification
    from hf_qknorm.conversion.orchestration.checks import ConversionCheckError
    from hf_qknorm.modeling import remote
    from tests._support.convert_support import hook_source_skipping_the_norm

    def uncovered(model, *args, **kwargs):
        raise UnsupportedModelError("mixtral: the float64 reference does not spell out this attention (test)")

    monkeypatch.setattr(verification, "verify", uncovered)
    src = conversions.tiny_source("mixtral", tmp_path / "src")
    real = remote.remote_files

    def edited(*args):
        files = real(*args)
        files["qknorm_hooks.py"] = hook_source_skipping_the_norm(files["qknorm_hooks.py"])
        return files

    monkeypatch.setattr(remote, "remote_files", edited)
    with pytest.raises(ConversionCheckError, match=r"logits without the plugin \(its remote code.*differ.*nothing"):
        convert(src, tmp_path / "out", QKNormConfig("qk_norm"), calibrate=False, progress=False, log=_quiet)
    assert not (tmp_path / "out").exists()
    convert(
        src, tmp_path / "out", QKNormConfig("qk_norm"), calibrate=False, progress=False, log=_quiet, verify="plugin"
    )
    assert (tmp_path / "out").is_dir()  # the plugin alone cannot see what the shipped code does


@pytest.mark.spawns
def test_a_checkpoint_whose_qkv_transformers_splits_on_loading_converts(tmp_path):
    """Sarvam MoE stores attention.query_key_value (and query_layernorm), which Transformers renames and splits into
    q/k/v on loading: the streamed conversion reads it the same way, folds qkv_norm's pre-norm into the stored tensor
    and writes the source's layout back; its own q/k norms make qk_norm / rmsnorm a plain Sarvam MoE."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if "sarvam_moe" not in CONFIG_MAPPING_NAMES:
        pytest.skip("Sarvam MoE is not in this Transformers")
    rows = {}
    for scheme, norm in (("qkv_norm", None), ("qk_norm", "rmsnorm")):
        row = rows[scheme] = _convert_one(tmp_path, "sarvam_moe", scheme, norm)
        written = _tensors(row["out"])
        assert "model.layers.0.attention.query_key_value.weight" in written  # the source's own layout
        assert not any("self_attn.q_proj" in k for k in written)
    assert (rows["qkv_norm"]["result"].export, rows["qk_norm"]["result"].export) == ("qknorm", "native")
    _check_as_loaded(tmp_path, "sarvam_moe", rows)


def _check_as_loaded(tmp_path, model_type, rows, auto="AutoModelForCausalLM"):
    """Each converted folder of ``rows`` (scheme -> :func:`_convert_one`'s row) computes the converted model in
    memory, with the plugin and in a fresh interpreter without it (loaded by ``auto``), and the report's perplexities
    are the source's and the converted model's own."""
    jobs = [{"name": scheme, "path": str(row["out"]), "remote": row["result"].export == "qknorm", "ids": IDS.tolist(),
             "mask": MASK.tolist(), "auto": auto} for scheme, row in rows.items()]  # fmt: skip
    got = run_without_plugin(tmp_path, jobs)
    for scheme, row in rows.items():
        _close(row["plugin"], row["memory"], f"{model_type} {scheme}: with the plugin")
        _close(got[scheme]["logits"], row["memory"], f"{model_type} {scheme}: without the plugin")
        assert row["result"].report.ppl_original == pytest.approx(row["ppl_source"], rel=1e-4)
        assert row["result"].report.ppl_calibrated == pytest.approx(row["ppl_converted"], rel=1e-4)


@pytest.mark.spawns
def test_a_checkpoint_whose_experts_transformers_transposes_on_loading_converts(tmp_path):
    """Qwen3-VL-MoE checkpoints on the Hub store each expert's down projection transposed; Transformers transposes
    it on loading where its shape is not the model's (``Transpose(1, 2, check_dims=True)``). The tiny source is
    written in that layout: the streamed conversion reads it as ``from_pretrained`` does (the report's perplexities
    are the loaded model's), and the written folder keeps the source's layout and loads with and without the
    plugin."""
    from safetensors.torch import save_file
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if "qwen3_vl_moe" not in CONFIG_MAPPING_NAMES:
        pytest.skip("Qwen3-VL-MoE is not in this Transformers")
    src = tmp_path / "qwen3_vl_moe" / "source"
    conversions.tiny_source("qwen3_vl_moe", src)
    stored = _tensors(src)
    down = [k for k in stored if k.endswith("mlp.experts.down_proj")]
    assert down and all(stored[k].shape[1] != stored[k].shape[2] for k in down)  # the transposed layout is telling
    hub = {k: v.transpose(1, 2).contiguous() if k in down else v for k, v in stored.items()}
    save_file(hub, str(src / "model.safetensors"), metadata={"format": "pt"})
    loaded = load_pretrained(src)
    torch.testing.assert_close(loaded.state_dict()[down[0]], stored[down[0]], rtol=0, atol=0)  # Transformers' turn
    rows = {}
    for scheme, norm in (("qk_norm_cap", None), ("qkv_norm", None)):
        row = rows[scheme] = _convert_one(tmp_path, "qwen3_vl_moe", scheme, norm)
        assert "refused" not in row, row.get("refused")
        written = _tensors(row["out"])
        for key in down:  # the source's own layout, byte for byte
            torch.testing.assert_close(written[key], hub[key], rtol=0, atol=0)
    _check_as_loaded(tmp_path, "qwen3_vl_moe", rows, auto="AutoModelForImageTextToText")


FUSED_QKV = {"sarvam_moe": "attention.query_key_value.weight", "molmo2": "self_attn.att_proj.weight"}


@pytest.mark.spawns
@pytest.mark.parametrize("scheme, norm", [("qk_norm", "l2"), ("qkv_norm", "layernorm")])
@pytest.mark.parametrize("model_type", sorted(FUSED_QKV))
def test_a_healed_projection_split_off_a_stored_tensor_is_written_back_into_it(
    tmp_path, model_type, scheme, norm, monkeypatch
):
    """Sarvam MoE and Molmo 2 store q, k and v as one tensor that Transformers splits by rows on loading (Molmo 2
    also its MLP's up and gate, ``ff_proj``, by ``Chunk``). A heal fits q, k and v apart; the written checkpoint
    holds them joined again in the source's layout, so that Transformers' own split of the written folder gives back
    exactly the healed values the conversion wrote (recorded on their way to the writer), with and without the
    plugin (``verify="full"``); a tensor the heal does not touch (Molmo 2's ``ff_proj``) is the source's, byte for
    byte; with ``qkv_norm`` the removed pre-norm's fold is in the healed values, not applied twice. (Before: the
    last healed piece was written in place of the whole tensor, and the folder did not load.)"""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from hf_qknorm.conversion.healing.heal import HealSettings
    from hf_qknorm.conversion.output import writing

    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"{model_type} is not in this Transformers")
    src = conversions.tiny_source(model_type, tmp_path / "source")
    stored = _tensors(src)
    fused = sorted(k for k in stored if k.endswith(FUSED_QKV[model_type]))
    assert fused, sorted(stored)[:8]
    written_values = {}
    plan = writing.plan_weights

    def spy(weights, family, cfg, new_values, forms=None):
        written_values.update({k: v.detach().clone() for k, v in new_values.items()})
        return plan(weights, family, cfg, new_values, forms)

    monkeypatch.setattr(writing, "plan_weights", spy)
    heal = HealSettings(tokens=2048, blocks=4, text="calibration", lr_search=False)
    result = convert(src, tmp_path / "out", QKNormConfig(scheme, norm=norm), SETTINGS, calibration_text=TEXT,
                     heal=heal, verify="full", progress=False, log=_quiet)  # fmt: skip
    assert result.report.heal["layers_kept"] > 0
    written = _tensors(tmp_path / "out")
    assert [k for k in written if k.endswith(FUSED_QKV[model_type])] == fused  # the source's own layout
    assert not any(".q_proj." in k for k in written if ("blocks." in k or "layers." in k) and "vision" not in k)
    assert any(not torch.equal(written[k], stored[k]) for k in fused)  # the heal was written
    for key in (k for k in stored if k.endswith("ff_proj.weight")):
        assert torch.equal(written[key], stored[key]), key
    loaded = load_pretrained(tmp_path / "out").eval().state_dict()
    healed = [n for n in written_values if n.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj")]
    assert len(healed) >= 3, sorted(written_values)
    for name in healed:
        torch.testing.assert_close(loaded[name], written_values[name].to(loaded[name].dtype), rtol=0, atol=0)


def test_healing_refuses_attention_weights_it_could_not_write_back(tmp_path, monkeypatch):
    """An attention parameter made on loading by anything but a split of rows (here: a Llama whose q projection
    is declared made by a transpose) cannot take a healed value in the source's layout: the heal is refused in one
    line before any work, naming the tensor and the operation; without --heal the same model converts."""
    from transformers import conversion_mapping
    from transformers.core_model_loading import Transpose, WeightConverter

    from hf_qknorm.conversion.healing.heal import HealSettings

    src = conversions.tiny_source("llama", tmp_path / "source")
    original = conversion_mapping.get_model_conversion_mapping

    def mapping(model, *args, **kwargs):
        rules = list(original(model, *args, **kwargs))
        q = "self_attn.q_proj.weight"
        return [*rules, WeightConverter(source_patterns=q, target_patterns=q, operations=[Transpose(0, 1)])]

    monkeypatch.setattr(conversion_mapping, "get_model_conversion_mapping", mapping)
    with pytest.raises(UnsupportedModelError, match=r"q_proj\.weight on loading .* Transpose.* without --heal"):
        convert(src, tmp_path / "out", QKNormConfig("qk_norm"), SETTINGS, calibration_text=TEXT,
                heal=HealSettings(tokens=1024, blocks=2, text="calibration"), progress=False, log=_quiet)  # fmt: skip
    assert not (tmp_path / "out").exists()


@pytest.mark.spawns
@pytest.mark.parametrize("model_type", ["molmo2", "ernie4_5_vl_moe"])
def test_a_checkpoint_whose_tensors_transformers_chunks_on_loading_converts(tmp_path, model_type):
    """Molmo 2's MLP (``ff_proj``: up and gate, by ``Chunk``) and ERNIE 4.5-VL-MoE's experts (split between text and
    vision experts by an operation that reads the config) are made on loading from tensors stored otherwise: the
    streamed conversion reads them as ``from_pretrained`` does (the report's perplexities are the loaded model's) and
    the written folder computes the converted model with and without the plugin. (Both were refused before.)"""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"{model_type} is not in this Transformers")
    if model_type == "ernie4_5_vl_moe" and Version(transformers.__version__) < Version("5.17"):
        pytest.skip("ERNIE 4.5-VL-MoE's config of this Transformers rejects its own defaults (use_bias) when saved")
    rows = {}
    for scheme in ("qk_norm_cap", "qkv_norm"):
        row = rows[scheme] = _convert_one(tmp_path, model_type, scheme)
        assert "refused" not in row, row.get("refused")
    _check_as_loaded(tmp_path, model_type, rows, auto="AutoModelForImageTextToText")

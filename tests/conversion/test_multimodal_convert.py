"""Conversion of multimodal checkpoints: ``hf_qknorm.convert`` on a tiny LLaVA (Llama language model) and Gemma 3
(Gemma 3 language model) calibrates the language model's attention on text, copies the vision tower, projector and
embeddings unchanged, and writes a folder whose logits are those of the source patched with the written norms,
computed here in float64 from the source's own tensors. A LLaVA ``qk_norm``/``rmsnorm`` conversion is a plain LLaVA
with a Qwen3 language model, a Gemma 3 one a plain Gemma 3 (its own ``1 + w`` q/k norms); the rest remote code."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import hf_qknorm
from hf_qknorm import QKNormConfig
from hf_qknorm.conversion.orchestration.converter import convert
from hf_qknorm.conversion.orchestration.coverage import SOURCE_VOCAB, tiny_source
from hf_qknorm.portable.families import UnsupportedModelError
from tests._support.convert_support import SHORT_TEXT, SMALL, leftovers, quiet, tree_hash

TYPES = ("llava", "gemma3")
CAP = 2.0  # a cap that bends the tiny models' logits
# (scheme, norm) -> the format each type is written in
VARIANTS = {
    ("qk_norm_cap", "layernorm"): {"llava": "qknorm", "gemma3": "qknorm"},
    ("qk_norm", "rmsnorm"): {"llava": "qwen3", "gemma3": "native"},
}
FAST = dataclasses.replace(SMALL, steps=0, calibration_blocks=4, eval_blocks=2, agreement_tokens=2)
NORM = re.compile(r"\.(q_norm|k_norm)\.")


def _cfg(scheme, norm):
    return QKNormConfig(scheme, norm=norm, softcap=CAP if "cap" in scheme else None)


def _convert(src, dst, cfg, **kwargs):
    """``convert`` with the tests' calibration settings and text, quiet, verified with the plugin."""
    return convert(
        src, dst, cfg, FAST, calibration_text=SHORT_TEXT, progress=False, log=quiet, verify="plugin", **kwargs
    )


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Per type: the source folder, its tree hash before, and each variant's result."""
    out = {}
    for model_type in TYPES:
        root = tmp_path_factory.mktemp(model_type)
        src = tiny_source(model_type, root / "source")
        before = tree_hash(src)
        results = {}
        for scheme, norm in VARIANTS:
            dst = root / f"{scheme}-{norm}"
            results[scheme, norm] = _convert(src, dst, _cfg(scheme, norm))
        out[model_type] = (src, before, results)
    return out


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _reference(src: Path, written: dict, cfg, offset: float) -> torch.nn.Module:
    """The source in float64, patched with ``cfg``, its new norms given the written values (``offset`` added: a
    plain Gemma 3 stores its gain ``1 + w`` as ``w``)."""
    from transformers import AutoModelForImageTextToText

    from hf_qknorm.conversion.output.keys import loaded_name

    model = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float64).eval()
    hf_qknorm.patch_model(model, cfg)
    params = dict(model.named_parameters())
    # the checkpoint's names are the model's after Transformers' renaming (Gemma 3 stores language_model.model.*)
    values = {loaded_name(k, model): v for k, v in written.items() if NORM.search(k)}
    new = [n for n in params if NORM.search(n)]
    assert new and set(new) == set(values)
    with torch.no_grad():
        for name in new:
            value = values[name].double()
            params[name].copy_(value + offset if name.endswith(".weight") else value)
    return model


def _ids():
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 2000, (2, 14), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    return ids, mask


@pytest.mark.parametrize("model_type", TYPES)
@pytest.mark.parametrize("scheme, norm", list(VARIANTS))
def test_written_folder_computes_the_patched_source(converted, model_type, scheme, norm):
    from transformers import AutoModelForImageTextToText

    src, _, results = converted[model_type]
    result = results[scheme, norm]
    assert result.export == VARIANTS[scheme, norm][model_type]
    written = _tensors(result.path)
    offset = 1.0 if result.export == "native" else 0.0
    want_model = _reference(src, written, _cfg(scheme, norm), offset)
    model = AutoModelForImageTextToText.from_pretrained(result.path).eval()
    assert model.dtype == torch.float32
    ids, mask = _ids()
    with torch.no_grad():
        want = want_model(input_ids=ids, attention_mask=mask).logits
        got = model(input_ids=ids, attention_mask=mask).logits.double()
    scale = float(want.abs().max())
    assert float((got[1] - want[1]).abs().max()) <= 1e-5 * scale
    assert float((got[0, 4:] - want[0, 4:]).abs().max()) <= 1e-5 * scale
    # the scheme is in force: the source computes something else (not Gemma 3's qk_norm/rmsnorm, its own norms)
    plain = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float64).eval()
    with torch.no_grad():
        moved = float((plain(input_ids=ids, attention_mask=mask).logits - want).abs().max())
    assert (moved <= 1e-5 * scale) if result.export == "native" else (moved > 1e-3 * scale)
    config = json.loads((result.path / "config.json").read_text())
    report = json.loads((result.path / "qknorm_conversion.json").read_text())
    assert report["export"] == result.export and report["load_with"] == "AutoModelForImageTextToText"
    assert report["language_model"] == "model.language_model"
    card = (result.path / "README.md").read_text()
    assert "AutoModelForImageTextToText" in card and "pipeline_tag: image-text-to-text" in card
    if result.export == "qwen3":
        assert config["model_type"] == "llava" and config["text_config"]["model_type"] == "qwen3"
        assert "with a `qwen3` language model" in card
    elif result.export == "native":
        assert config["model_type"] == "gemma3" and "auto_map" not in config
    else:
        assert config["model_type"] == f"qknorm_{model_type}" and "trust_remote_code=True" in card


@pytest.mark.parametrize("model_type", TYPES)
def test_everything_but_the_attention_norms_is_copied_bit_for_bit(converted, model_type):
    src, before, results = converted[model_type]
    source = _tensors(src)
    vision = [k for k in source if "language_model" not in k and not k.startswith("lm_head")]
    assert any("vision" in k for k in vision) and any("projector" in k for k in vision)
    for result in results.values():
        written = _tensors(result.path)
        for key, tensor in source.items():
            if NORM.search(key):
                continue
            assert key in written, key
            assert written[key].dtype == tensor.dtype and torch.equal(written[key], tensor), key
        added = set(written) - set(source)
        assert all(NORM.search(k) and "language_model." in k for k in added)
    assert tree_hash(src) == before  # the source is only read


@pytest.mark.spawns
def test_folders_load_without_the_plugin(converted):
    """One fresh interpreter that cannot import the plugin loads every written folder (remote code, or plain
    Transformers for the plain exports) and gives the logits the plugin gives."""
    from transformers import AutoModelForImageTextToText

    from hf_qknorm.verification.plain import logits_without_plugin

    ids, mask = _ids()
    jobs, want = [], {}
    for model_type, (_, _, results) in converted.items():
        for (scheme, _norm), result in results.items():
            key = f"{model_type}:{scheme}"
            model = AutoModelForImageTextToText.from_pretrained(result.path).eval()
            with torch.no_grad():
                want[key] = model(input_ids=ids, attention_mask=mask).logits
            jobs.append(
                {
                    "key": key,
                    "path": str(result.path),
                    "remote": result.export == "qknorm",
                    "auto": "AutoModelForImageTextToText",
                    "ids": ids.tolist(),
                    "mask": mask.tolist(),
                }
            )
    got = logits_without_plugin(jobs)
    for key, logits in want.items():
        row = got[key]
        assert "error" not in row, row.get("traceback")
        assert not row["module"].startswith("hf_qknorm")
        scale = float(logits.abs().max())
        assert float((row["logits"][1] - logits[1]).abs().max()) <= 1e-5 * scale, key
        assert float((row["logits"][0, 4:] - logits[0, 4:]).abs().max()) <= 1e-5 * scale, key


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    import hf_qknorm.conversion.output.export as export

    src = tiny_source("llava", tmp_path / "source")
    before = tree_hash(src)

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "copy_side_files", interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert(src, tmp_path / "out", "qk_norm_cap", calibrate=False, progress=False, log=quiet, verify="plugin")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
    assert tree_hash(src) == before


def test_refused_as_patching_refuses_before_any_work(tmp_path, monkeypatch):
    """A LLaVA whose language model is a Cohere (a parallel block): ``qkv_norm`` cannot remove its pre-norm, and
    convert says so in patching's words, before calibrating anything."""
    from transformers import AutoModelForImageTextToText, CohereConfig

    import hf_qknorm.conversion.calibration.layerwise as layerwise
    from hf_qknorm.verification.tiny import tiny_multimodal_config

    config = tiny_multimodal_config("llava")
    text = config.get_text_config()
    config.text_config = CohereConfig(
        vocab_size=SOURCE_VOCAB,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
    )
    config.image_token_id = SOURCE_VOCAB - 1
    model = AutoModelForImageTextToText.from_config(config).eval()
    model.save_pretrained(tmp_path / "source")
    with pytest.raises(UnsupportedModelError) as patching:
        hf_qknorm.patch_model(model, "qkv_norm")
    assert "parallel block" in str(patching.value)

    def no_work(*args, **kwargs):
        raise AssertionError("calibration started")

    monkeypatch.setattr(layerwise, "calibrate_checkpoint", no_work)
    with pytest.raises(UnsupportedModelError) as converting:
        convert(tmp_path / "source", tmp_path / "out", "qkv_norm", progress=False, log=quiet)
    assert str(converting.value) == str(patching.value)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_the_end_to_end_stage_is_refused_for_a_model_without_a_causal_lm_class(tmp_path):
    """The end-to-end stage trains the whole original as a causal LM, which LLaVA has no class for: refused before
    any work, naming the way that works."""
    from hf_qknorm.conversion.healing.heal import HealSettings

    src = tiny_source("llava", tmp_path / "source")
    heal = HealSettings(end_to_end_tokens=256)
    with pytest.raises(ValueError, match=r"'llava'.*--heal-end-to-end-tokens.*--heal-end-to-end-tokens 0"):
        convert(src, tmp_path / "out", "qk_norm_cap", FAST, heal=heal, progress=False, log=quiet)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model_type, text", [("llava", "calibration"), ("llava", "self"), ("gemma3", "self")])
def test_healed_conversion_changes_only_the_language_model(tmp_path, model_type, text):
    from hf_qknorm.conversion.healing.heal import HealSettings

    src = tiny_source(model_type, tmp_path / "source")
    heal = HealSettings(tokens=128, blocks=4, text=text, self_tokens=64)
    result = _convert(src, tmp_path / "out", _cfg("qk_norm_cap", "layernorm"), heal=heal)
    assert result.report.heal is not None
    assert (result.report.heal["generated_tokens"] > 0) == (text == "self")  # the original wrote its own heal text
    source, written = _tensors(src), _tensors(result.path)
    for key, tensor in source.items():
        if "language_model." not in key or ".layers." not in key:
            assert torch.equal(written[key], tensor), key


@pytest.mark.spawns
def test_the_coverage_column_converts_a_multimodal_type():
    from hf_qknorm.conversion.orchestration import coverage

    got = coverage.check_conversions(["llava"], variants=(("qk_norm", "rmsnorm"), ("qk_norm_cap", "layernorm")))
    assert got["llava"].status == coverage.CONVERTED, got["llava"].reason
    assert got["llava"].variants == {
        "qk_norm/rmsnorm": "ok (plain llava with a qwen3 text model; float64)",  # verify's reference, as a text type's
        "qk_norm_cap/layernorm": "ok (remote code; float64)",
    }


@pytest.mark.spawns
def test_a_model_whose_forward_needs_images_converts_through_its_language_model(tmp_path):
    """BLIP-2's forward takes no text alone: calibration, the checks and the reload run text on its OPT (a causal LM
    whose head is the whole model's). The written folder's language model computes the source's patched with the
    written norms (float64, here), with the plugin and without it; the source is untouched."""
    from transformers import AutoModelForImageTextToText

    from hf_qknorm.conversion.output.shards import load_pretrained
    from hf_qknorm.verification.plain import logits_without_plugin

    src = tiny_source("blip-2", tmp_path / "source")
    before = tree_hash(src)
    cfg = _cfg("qk_norm_cap", "layernorm")
    result = _convert(src, tmp_path / "out", cfg)
    assert result.export == "qknorm" and tree_hash(src) == before
    report = json.loads((result.path / "qknorm_conversion.json").read_text())
    assert report["language_model"] == "language_model" and report["load_with"] == "AutoModelForImageTextToText"
    want_model = _reference(src, _tensors(result.path), cfg, 0.0)
    ids, mask = _ids()
    with torch.no_grad():
        want = want_model.language_model(input_ids=ids, attention_mask=mask).logits
        got = load_pretrained(result.path).eval().language_model(input_ids=ids, attention_mask=mask).logits.double()
        plain = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float64).eval()
        moved = float((plain.language_model(input_ids=ids, attention_mask=mask).logits - want).abs().max())
    job = {"key": "0", "path": str(result.path), "remote": True, "ids": ids.tolist(), "mask": mask.tolist()}
    job.update(auto="AutoModelForImageTextToText", text_forward="language_model")
    row = logits_without_plugin([job])["0"]
    assert "error" not in row and row["module"].startswith("transformers_modules"), row.get("error")
    scale = float(want.abs().max())
    for logits in (got, row["logits"].double()):
        assert float((logits[1] - want[1]).abs().max()) <= 1e-5 * scale
        assert float((logits[0, 4:] - want[0, 4:]).abs().max()) <= 1e-5 * scale
    assert moved > 1e-4 * scale  # the scheme is in force (ten times the tolerance above)


@pytest.mark.spawns
def test_an_audio_model_loads_with_its_own_auto_class(tmp_path):
    """MOSS Transcribe-Diarize (audio in, text out) has no image-text-to-text class: its tiny checkpoint is saved,
    converted, described (report, card) and reloaded without the plugin as ``AutoModelForMultimodalLM``, the class
    its remote code maps -- its card says nothing of images."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from hf_qknorm.conversion.orchestration import coverage

    if "moss_transcribe_diarize" not in CONFIG_MAPPING:
        pytest.skip("MOSS Transcribe-Diarize is not in this Transformers")
    got = coverage.check_conversions(["moss_transcribe_diarize"], variants=(("qk_norm_cap", "layernorm"),))
    row = got["moss_transcribe_diarize"]
    assert row.status == coverage.CONVERTED, row.reason  # reloaded without the plugin with the plugin's logits
    src = tiny_source("moss_transcribe_diarize", tmp_path / "source")
    result = _convert(src, tmp_path / "out", _cfg("qk_norm_cap", "layernorm"))
    report = json.loads((result.path / "qknorm_conversion.json").read_text())
    assert report["load_with"] == "AutoModelForMultimodalLM"
    card = (result.path / "README.md").read_text()
    assert "AutoModelForMultimodalLM" in card and "image-text-to-text" not in card and "ImageTextToText" not in card


def test_a_head_tied_by_the_multimodal_config_converts(tmp_path):
    """Mistral 3 ties its output head to the embedding in its own config (its text config says untied): the
    checkpoint stores the embedding once, and the streamed calibration scores through it."""
    from transformers import AutoModelForImageTextToText

    src = tiny_source("mistral3", tmp_path / "source")
    assert not any(k.startswith("lm_head") for k in _tensors(src))
    result = _convert(src, tmp_path / "out", _cfg("qk_norm", "rmsnorm"))
    assert result.export == "qwen3" and result.report is not None
    config = json.loads((result.path / "config.json").read_text())
    assert config["model_type"] == "mistral3" and config["text_config"]["model_type"] == "qwen3"
    model = AutoModelForImageTextToText.from_pretrained(result.path)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_a_classifier_wrapping_a_language_model_is_refused_in_one_line(tmp_path):
    """ShieldGemma 2's checkpoints are a classifier holding a whole Gemma 3 model (its image-text-to-text Auto class
    is Gemma 3's, which Transformers cannot load its folders into): the tiny source is saved as that classifier, its
    own save and load keep every tensor, and a conversion is refused before any work with the reason."""
    from transformers import AutoConfig, ShieldGemma2ForImageClassification

    from hf_qknorm.modeling.saved import auto_class

    src = tiny_source("shieldgemma2", tmp_path / "source")
    config = AutoConfig.from_pretrained(src)
    assert auto_class(config).from_config(config).__class__ is ShieldGemma2ForImageClassification
    _, info = ShieldGemma2ForImageClassification.from_pretrained(src, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    before = tree_hash(src)
    with pytest.raises(UnsupportedModelError, match="'shieldgemma2'.*ShieldGemma2ForImageClassification.*classifier"):
        _convert(src, tmp_path / "out", _cfg("qk_norm", "rmsnorm"))
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == [] and tree_hash(src) == before
    assert auto_class(AutoConfig.from_pretrained(tiny_source("gemma3", tmp_path / "g3"))).__name__ == (
        "AutoModelForImageTextToText"
    )


def test_a_vision_tower_made_by_an_operation_not_reproduced_is_written_as_stored(tmp_path):
    """Step 3.7's checkpoints store the vision tower's attention as one ``in_proj`` that Transformers chunks and
    permutes on loading (the permutation is an operation the streamed conversion does not reproduce). The conversion
    never reads the vision tower, so those tensors are written bit for bit; the written folder, loaded by
    Transformers, computes the patched source. The same operation on a language-model tensor is refused
    (``key_map``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from hf_qknorm.conversion.output.keys import key_map
    from hf_qknorm.conversion.output.shards import skeleton

    if "step3p7" not in CONFIG_MAPPING:
        pytest.skip("Step 3.7 is not in this Transformers")
    src = tiny_source("step3p7", tmp_path / "source")
    before = tree_hash(src)
    source = _tensors(src)
    in_proj = [k for k in source if "in_proj" in k]
    assert in_proj and all("vision" in k for k in in_proj)
    result = _convert(src, tmp_path / "out", _cfg("qk_norm_cap", "layernorm"))
    written = _tensors(result.path)
    for key in in_proj:
        assert torch.equal(written[key], source[key]), key
    assert tree_hash(src) == before
    from transformers import AutoConfig, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(result.path, dtype=torch.float64).eval()
    assert hf_qknorm.verify(model, generate=False).ok
    keys = dict.fromkeys(source)
    with pytest.raises(UnsupportedModelError, match=r"in_proj.*\(PermuteForRope\).*does not reproduce"):
        key_map(skeleton(AutoConfig.from_pretrained(src)), keys, reads=lambda name: True)


def test_a_tiny_multimodal_config_is_the_one_its_save_and_load_gives(tmp_path):
    """Idefics2's config gives its perceiver the text model's width when it is built: a tiny config that shrank the
    perceiver on its own saved a checkpoint that its own saved config could not load. The tiny config is built as a
    save and load gives it back, and its checkpoint loads with every tensor in place."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from hf_qknorm.modeling.saved import auto_class
    from hf_qknorm.verification.tiny import tiny_multimodal_config

    if "idefics2" not in CONFIG_MAPPING:
        pytest.skip("idefics2 is not in this Transformers")
    config = tiny_multimodal_config("idefics2")
    assert config.perceiver_config.hidden_size == config.text_config.hidden_size
    src = tiny_source("idefics2", tmp_path / "src")
    again = AutoConfig.from_pretrained(src)
    assert again.to_dict()["perceiver_config"] == config.to_dict()["perceiver_config"]
    _, info = auto_class(again).from_pretrained(src, output_loading_info=True)
    assert not info.get("missing_keys") and not info.get("mismatched_keys")


def test_a_tiny_config_its_class_accepts_only_once_fitted_is_built_as_is():
    """Cosmos 3 Edge's RoPE sections are fitted to the tiny heads once its model is built: before that its own class
    refuses the config, so the round trip above leaves it as built (its checkpoint's load is checked where saved)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from hf_qknorm.verification.tiny import tiny_multimodal_config

    if "cosmos3_edge" not in CONFIG_MAPPING:
        pytest.skip("cosmos3_edge is not in this Transformers")
    assert tiny_multimodal_config("cosmos3_edge").model_type == "cosmos3_edge"

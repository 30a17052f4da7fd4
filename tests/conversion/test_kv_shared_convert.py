"""Converting Gemma 4's layers without a key or value projection of their own: ``attention_k_eq_v`` layers (values
from the keys' projection) convert, heal and are checked against the float64 reference; KV-shared layers, and a
tensor outside the layers whose size depends on the layer count (per-layer input embeddings), are refused in one
line before anything is written."""

from __future__ import annotations

import shutil

import pytest
import torch

import hf_qknorm
from hf_qknorm import UnsupportedModelError
from tests._support.tiny_models import kv_shared_gemma4


def _source(tmp_path, config):
    from transformers import AutoModelForCausalLM

    from hf_qknorm.conversion.orchestration.coverage import _widen_vocab
    from hf_qknorm.data import bundled_model_dir

    _widen_vocab(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for prm in model.parameters():
            if prm.dim() == 1:  # gains off their initial values, so that a gain carried wrongly shows
                prm.add_(0.3 * torch.randn(prm.shape, generator=gen))
    src = tmp_path / "src"
    model.save_pretrained(src)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(bundled_model_dir() / name, src / name)
    return src


def _gemma4_config(**changes):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from hf_qknorm.verification.tiny import tiny_config

    if "gemma4_text" not in CONFIG_MAPPING:
        pytest.skip("gemma4_text is not in this Transformers")
    config = tiny_config("gemma4_text")
    for name, value in changes.items():
        setattr(config, name, value)
    return config


@pytest.mark.parametrize("scheme, norm", [("qk_norm_cap", "rmsnorm"), ("qk_norm", "l2")])
def test_values_from_the_keys_projection_convert_heal_and_verify(tmp_path, scheme, norm):
    src = _source(tmp_path, _gemma4_config(attention_k_eq_v=True))
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(src)
    assert [getattr(layer.self_attn, "v_proj", None) is None for layer in source.model.layers] == [False, True]
    messages = []
    result = hf_qknorm.convert(
        src,
        tmp_path / "out",
        hf_qknorm.QKNormConfig(scheme, norm=norm, softcap=10.0 if scheme.endswith("cap") else None),
        heal=hf_qknorm.HealSettings(tokens=2048, blocks=4, text="calibration", lr_search=False),
        calibration_text="wikitext2",
        verify="plugin",
        progress=False,
        log=messages.append,
    )
    assert not any(m.startswith("float64 reference not run") for m in messages), messages
    assert result.export == "qknorm"
    import json

    heal = json.loads((tmp_path / "out" / "qknorm_conversion.json").read_text())["heal"]
    assert len(heal["layer_errors"]) == 2 and all(after <= before for before, after in heal["layer_errors"])


def test_kv_shared_layers_are_refused_before_anything_is_written(tmp_path):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "gemma4_text" not in CONFIG_MAPPING:
        pytest.skip("gemma4_text is not in this Transformers")
    src = _source(tmp_path, kv_shared_gemma4().config)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in src.iterdir())
    with pytest.raises(UnsupportedModelError, match="layer 2 reuses an earlier layer's keys and values"):
        hf_qknorm.convert(src, tmp_path / "out", "qk_norm_cap", calibration_text="wikitext2", progress=False)
    assert not (tmp_path / "out").exists()
    assert sorted((p.name, p.stat().st_mtime_ns) for p in src.iterdir()) == before


def test_a_tensor_sized_by_the_layer_count_is_refused_in_one_line(tmp_path):
    """Three layers and per-layer input embeddings (a tensor whose width is layers x width): the checks that load
    the first two layers cannot load it, so the conversion is refused naming the tensor, not failed in the loader."""
    config = _gemma4_config()
    if not getattr(config, "hidden_size_per_layer_input", 0):
        pytest.skip("this Transformers' Gemma 4 has no per-layer input embeddings")
    wide = next(iter(config.to_dict()["per_layer_config"].values()))  # the full-attention layers' own sizes
    config.num_hidden_layers = 3
    config.layer_types = ["sliding_attention", "full_attention", "full_attention"]
    config.per_layer_config = {1: dict(wide), 2: dict(wide)}
    src = _source(tmp_path, config)
    with pytest.raises(UnsupportedModelError, match="depends on the number of layers") as info:
        hf_qknorm.convert(src, tmp_path / "out", "qk_norm_cap", calibration_text="wikitext2", progress=False)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()

"""Converting layers without a key or value projection of their own: Gemma 4's ``attention_k_eq_v`` layers (values
from the keys' projection), and Gemma 3n's and Gemma 4's KV-shared layers (they attend over the keys and values an
earlier layer stored). A KV-shared layer is calibrated and healed on the keys its store layer's converted weights
make, each stream of the streamed conversion with its own store (tests/conversion/test_kv_shared_streams.py); here
the whole command: written, reloaded and checked against float64. A tensor outside the layers whose size depends
on the layer count (per-layer input embeddings) is cut for the checks' view of the first layers (its cut checked
against the whole model's hidden states), an unknown one refused in one line."""

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


def inspect_source_reusing(src) -> bool:
    """Whether the saved model at ``src`` has layers without a key projection of their own."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src)
    return any(getattr(layer.self_attn, "k_proj", None) is None for layer in model.model.layers)


def _kv_shared_source(tmp_path, kind):
    from hf_qknorm.verification.tiny import tiny_config

    if kind == "gemma4":
        return _source(tmp_path, kv_shared_gemma4().config)
    config = tiny_config("gemma3n_text")
    assert config.num_kv_shared_layers == 2 and config.num_hidden_layers == 4
    return _source(tmp_path, config)


@pytest.mark.parametrize(
    "kind, scheme, norm, heal",
    [
        ("gemma4", "qk_norm_cap", "rmsnorm", {}),
        ("gemma4", "qk_norm", "l2", {"inputs": "converted"}),
        ("gemma3n_text", "qk_norm_cap", "layernorm", {"end_to_end_tokens": 64}),
    ],
)
def test_kv_shared_layers_convert_heal_and_verify(tmp_path, kind, scheme, norm, heal):
    """The whole command on a model whose last layers reuse keys (healed on the original's inputs, on the healed
    model's own, and with the end-to-end stage): the source untouched, the written folder checked by the command
    (every layer up to the first reusing one) and here again -- the float64 reference over every layer, and its
    logits those of the source patched with the written norms and healed weights."""
    from transformers import AutoModelForCausalLM

    from hf_qknorm.verification import verify
    from tests._support.convert_support import tree_hash

    model_type = "gemma4_text" if kind == "gemma4" else kind
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"{model_type} is not in this Transformers")
    src = _kv_shared_source(tmp_path, kind)
    if not inspect_source_reusing(src):
        pytest.skip("this Transformers shares keys and values only through its cache (refused: below)")
    before = tree_hash(src)
    messages = []
    cfg = hf_qknorm.QKNormConfig(scheme, norm=norm, softcap=10.0 if scheme.endswith("cap") else None)
    result = hf_qknorm.convert(
        src,
        tmp_path / "out",
        cfg,
        heal=hf_qknorm.HealSettings(tokens=2048, blocks=4, text="calibration", lr_search=False, **heal),
        calibration_text="wikitext2",
        verify="plugin",
        progress=False,
        log=messages.append,
    )
    assert tree_hash(src) == before
    config = AutoModelForCausalLM.from_pretrained(src).config
    layers, first_reusing = config.num_hidden_layers, config.num_hidden_layers - config.num_kv_shared_layers
    # the command's checks reached the first reusing layer; its report says which roles it projects
    assert any(f"first {first_reusing + 1} layers" in m for m in messages), messages
    assert f"| {first_reusing} | " in result.report.layer_table() and "| - | - |" in result.report.layer_table()
    written = AutoModelForCausalLM.from_pretrained(result.path).eval()
    assert verify(written).ok
    reference = AutoModelForCausalLM.from_pretrained(src).eval()
    hf_qknorm.patch_model(reference, cfg)
    from safetensors.torch import load_file

    stored = load_file(result.path / "model.safetensors")
    state = reference.state_dict()
    with torch.no_grad():
        for name, tensor in stored.items():
            if name in state:
                state[name].copy_(tensor)
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(written(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
    heal = result.report.heal
    assert len(heal["layer_errors"]) == layers


def _three_layers_with_per_layer_inputs():
    """A tiny Gemma 4 of three layers with per-layer input embeddings (whose width is layers x width)."""
    config = _gemma4_config()
    if not getattr(config, "hidden_size_per_layer_input", 0):
        pytest.skip("this Transformers' Gemma 4 has no per-layer input embeddings")
    wide = next(iter(config.to_dict()["per_layer_config"].values()))  # the full-attention layers' own sizes
    config.num_hidden_layers = 3
    config.layer_types = ["sliding_attention", "full_attention", "full_attention"]
    config.per_layer_config = {1: dict(wide), 2: dict(wide)}
    return config


def test_a_view_of_the_first_layers_cuts_the_per_layer_inputs_exactly(tmp_path):
    """The checks' view of the first two layers of a three-layer Gemma 4 with per-layer input embeddings (stored in
    shards, with an index): its hidden states after those layers are the whole model's, computed by Transformers
    from the unchanged folder; the folder itself is untouched."""
    from transformers import AutoModelForCausalLM

    from hf_qknorm.conversion.orchestration.checks import layer_view
    from tests._support.convert_support import tree_hash

    config = _three_layers_with_per_layer_inputs()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    src = tmp_path / "src"
    model.save_pretrained(src, max_shard_size="100KB")
    assert (src / "model.safetensors.index.json").exists()
    before = tree_hash(src)
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(5))

    def second_layer_output(m):  # the model's last hidden state has its final norm applied: read the block's
        seen = []
        hook = m.model.layers[1].register_forward_hook(lambda mod, a, out: seen.append(out))
        m(ids)
        hook.remove()
        return seen[0][0] if isinstance(seen[0], tuple) else seen[0]

    with torch.no_grad():
        want = second_layer_output(model)
        with layer_view(src, 2) as view:
            cut = AutoModelForCausalLM.from_pretrained(view).eval()
            got = second_layer_output(cut)
    assert cut.config.num_hidden_layers == 2
    assert cut.model.embed_tokens_per_layer.weight.shape[1] == 2 * config.hidden_size_per_layer_input
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert tree_hash(src) == before


def test_an_unknown_tensor_sized_by_the_layer_count_is_refused_in_one_line(tmp_path, monkeypatch):
    """A tensor outside the layers whose size depends on the layer count and whose packing hf_qknorm does not know
    (here: the per-layer inputs, with the known packings forgotten) is refused naming it, nothing written."""
    from hf_qknorm.conversion.orchestration import checks

    monkeypatch.setattr(checks, "LAYER_PACKED", {})
    config = _three_layers_with_per_layer_inputs()
    src = _source(tmp_path, config)
    with pytest.raises(UnsupportedModelError, match="depends on the number of layers") as info:
        hf_qknorm.convert(src, tmp_path / "out", "qk_norm_cap", calibration_text="wikitext2", progress=False)
    assert "\n" not in str(info.value) and "per_layer" in str(info.value)
    assert not (tmp_path / "out").exists()


def test_a_kv_shared_heal_is_not_split_over_processes(monkeypatch):
    """Layers healed on the keys an earlier layer's fit kept cannot be fitted side by side: refused in one line
    naming the layer, before any work (one process: allowed)."""
    from hf_qknorm.conversion.healing import heal
    from hf_qknorm.conversion.orchestration import ranks

    heal.check_world(hf_qknorm.HealSettings(), (2, 3))
    monkeypatch.setattr(ranks, "world", lambda: 2)
    with pytest.raises(ValueError, match="layer 2 attends over an earlier layer's keys") as info:
        heal.check_world(hf_qknorm.HealSettings(), (2, 3))
    assert "\n" not in str(info.value)
    heal.check_world(hf_qknorm.HealSettings(), ())


def test_kv_sharing_through_the_cache_only_is_refused_in_one_line(tmp_path):
    """Where this Transformers' Gemma 3n shares keys and values only through its cache (5.4: without one every layer
    computes its own, 0.43 apart on the tiny model), the model computes two things: refused before any work."""
    from transformers import AutoModelForCausalLM

    from hf_qknorm.verification.tiny import tiny_config

    try:
        config = tiny_config("gemma3n_text")
    except Exception as exc:  # noqa: BLE001 - the tiny config itself may not build on an old Transformers
        pytest.skip(f"no tiny gemma3n_text here ({type(exc).__name__})")
    model = AutoModelForCausalLM.from_config(config)
    if any(getattr(layer.self_attn, "k_proj", None) is None for layer in model.model.layers):
        pytest.skip("this Transformers shares the keys and values in every forward (converted above)")
    src = _source(tmp_path, config)
    with pytest.raises(UnsupportedModelError, match="only through a cache") as info:
        hf_qknorm.convert(src, tmp_path / "out", "qk_norm_cap", calibration_text="wikitext2", progress=False)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()

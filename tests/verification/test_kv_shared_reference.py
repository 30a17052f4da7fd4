"""verify's float64 reference on layers without keys and values of their own: a KV-shared layer (Gemma 3n, Gemma 4's
E sizes) attends over the keys and values of the last earlier layer that stores the entry it reads -- both derived
from fresh instances of Transformers' classes, never from the model under test -- so its reference takes them from
that layer's formulas on that layer's recorded input; in a cached generation it runs at the last positions only.
A layer whose values are its keys' projection (``attention_k_eq_v``) has them so in the reference."""

from __future__ import annotations

import inspect

import pytest
import torch

import hf_qknorm
from hf_qknorm.verification import derive
from hf_qknorm.verification.layers import ReferenceModel
from tests._support.tiny_models import kv_shared_gemma4


def _known(model_type: str) -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"{model_type} is not in this Transformers")


def _build(kind: str):
    from transformers import AutoModelForCausalLM

    from hf_qknorm.verification.tiny import tiny_config

    if kind == "gemma4_kv_shared":
        _known("gemma4_text")
        return kv_shared_gemma4()
    model_type = "gemma3n_text" if kind == "gemma3n_text" else "gemma4_text"
    _known(model_type)
    config = tiny_config(model_type)
    if kind == "gemma4_k_eq_v":
        config.attention_k_eq_v = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    if kind == "gemma3n_text" and not any(getattr(a, "is_kv_shared_layer", False) for a in _attns(model)):
        pytest.skip("this Transformers' tiny Gemma 3n has no KV-shared layer")
    forward = inspect.signature(type(_attns(model)[0]).forward)
    if kind == "gemma3n_text" and "shared_kv_states" not in forward.parameters:
        # Transformers 5.4's reads the shared keys from the cache alone: it computes one thing with a cache and
        # another without (its own tests' business), so there is no one model to verify
        pytest.skip("this Transformers' Gemma 3n shares keys and values through its cache only")
    return model


def _attns(model):
    return [layer.self_attn for layer in model.model.layers]


SETTINGS = [
    None,
    dict(scheme="qk_norm_cap", norm="layernorm", softcap=5.0),
    dict(scheme="qk_norm", norm="l2"),
    dict(scheme="soft_cap", softcap=3.0),
]


@pytest.mark.parametrize("kind", ["gemma4_kv_shared", "gemma3n_text", "gemma4_k_eq_v"])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "unpatched" if s is None else f"{s['scheme']}")
def test_kv_shared_and_k_eq_v_layers_verify_against_float64(kind, settings):
    model = _build(kind)
    if settings is not None:
        hf_qknorm.patch_model(model, **settings)
    report = hf_qknorm.verify(model)
    assert report.ok, str(report)
    ref = ReferenceModel(model)
    shared = [i for i, a in enumerate(_attns(model)) if getattr(a, "is_kv_shared_layer", False)]
    assert {i: ref.spec(i).kv_from for i in shared} == ref._kv_from
    if kind == "gemma4_k_eq_v":  # the values of the layers without v_proj are their keys' projection
        lacking = [i for i, a in enumerate(_attns(model)) if getattr(a, "v_proj", None) is None]
        weights = [ref.spec(i).weights for i in lacking]
        assert lacking and all(torch.equal(w["wv"], w["wk"]) for w in weights)
        return
    assert shared  # the shared layers were compared, on every probe, generation included
    for i in shared:
        assert {c.probe for c in report.checks if c.layer == i} >= {"unpadded", "padded", "cache-unpadded"}


def test_the_source_of_a_reusing_layer_is_derived_from_fresh_instances():
    model = _build("gemma4_kv_shared")
    attns, config = _attns(model), model.config
    written = [derive.written_keys(a, config, i, "shared_kv_states") for i, a in enumerate(attns)]
    assert written[:2] == [{"sliding_attention"}, {"full_attention"}] and written[2] == set()
    kv, head_dim = config.num_key_value_heads, attns[2].head_dim
    assert derive.reused_entry(attns[2], config, 2, "shared_kv_states", kv, head_dim) == "full_attention"
    assert ReferenceModel(model)._kv_from == {2: 1}  # the full-attention layer that stored it, not the sliding one


def test_keys_changed_on_the_way_to_the_reusing_layer_fail_verification():
    """After patching, a hook hands the KV-shared layer doubled keys: the model no longer computes what its
    structure says, and verify fails that layer (never passes it)."""
    model = _build("gemma4_kv_shared")
    hf_qknorm.patch_model(model, scheme="qk_norm_cap", norm="rmsnorm", softcap=5.0)
    shared = _attns(model)[2]

    def doubled(module, args, kwargs):
        states = kwargs.get("shared_kv_states")
        if states is not None and module.layer_type in states:
            k, v = states[module.layer_type]
            kwargs["shared_kv_states"] = {**states, module.layer_type: (2 * k, v)}
        return args, kwargs

    shared.register_forward_pre_hook(doubled, with_kwargs=True)
    report = hf_qknorm.verify(model, generate=False)
    assert not report.ok
    assert {c.layer for c in report.checks if not c.ok and c.layer is not None} == {2}


def test_a_reusing_layer_whose_cap_is_dropped_fails_verification():
    """The KV-shared layer's own side -- its query, its cap -- is still checked: its cap removed after patching is
    found at that layer."""
    model = _build("gemma4_kv_shared")
    hf_qknorm.patch_model(model, scheme="qk_norm_cap", norm="rmsnorm", softcap=2.0)
    _attns(model)[2].__dict__["_qknorm_softcap"] = None
    report = hf_qknorm.verify(model, generate=False)
    assert not report.ok
    assert 2 in {c.layer for c in report.checks if not c.ok}

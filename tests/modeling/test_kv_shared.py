"""Layers without a key or value projection of their own: Gemma 3n's and Gemma 4's KV-shared layers (they reuse the
keys and values an earlier layer of their kind stored) and Gemma 4's ``attention_k_eq_v`` layers (their values are
their keys' projection). Such a model normalises q and k itself, so the scheme's norms take the places of its own:
a KV-shared layer's query norm, and the keys its store layer normalised.

The reference is the unpatched model run through an attention function written here (float64, the cap applied to
the logits, masks read as given), so nothing of the plugin computes what the patched model is compared with."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hf_qknorm
from hf_qknorm import UnsupportedModelError
from tests._support.tiny_models import kv_shared_gemma4
from tests._support.tiny_models import tiny_model as small_model

REFERENCE = "kv_shared_test_reference"
CAP = 2.0


def _known(model_type: str) -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"{model_type} is not in this Transformers")


def _build(kind: str, dtype=torch.float64) -> nn.Module:
    """A tiny model of ``kind`` in ``dtype``, random weights and q/k gains (so that a gain carried wrongly shows)."""
    from transformers import AutoModelForCausalLM

    from hf_qknorm.verification.tiny import tiny_config

    if kind == "gemma4_kv_shared":
        _known("gemma4_text")
        model = kv_shared_gemma4()
    else:
        model_type = "gemma4_text" if kind == "gemma4_k_eq_v" else "gemma3n_text"
        _known(model_type)
        config = tiny_config(model_type)
        if kind == "gemma4_k_eq_v":
            config.attention_k_eq_v, config.num_global_key_value_heads = True, 1
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
    model = model.to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    return model


def _lacks(model: nn.Module) -> list[tuple[bool, bool]]:
    """Per layer: whether its attention has a key projection, and a value projection, of its own."""
    return [
        (isinstance(getattr(layer.self_attn, "k_proj", None), nn.Module),
         isinstance(getattr(layer.self_attn, "v_proj", None), nn.Module))
        for layer in model.model.layers
    ]  # fmt: skip


def _reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs):
    """Softmax attention in float64 with the test's cap on the logits; the mask as Transformers hands it."""
    groups = query.shape[1] // key.shape[1]
    k, v = (t.double().repeat_interleave(groups, 1) for t in (key, value))
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    s = scaling * query.double() @ k.transpose(-1, -2)
    s = CAP * torch.tanh(s / CAP) if CAP_ON[0] else s
    p = torch.softmax(s.masked_fill(~_allowed(s, attention_mask, sliding_window), float("-inf")), dim=-1)
    out = (p @ v).to(query.dtype).transpose(1, 2).contiguous()
    return out, None


def _allowed(s, attention_mask, sliding_window):
    """The (query, key) pairs the mask allows, for logits ``s``."""
    t, n = s.shape[-2:]
    if attention_mask is None:
        i, j = torch.arange(t)[:, None] + n - t, torch.arange(n)[None, :]
        return (j <= i) & ((i - j < sliding_window) if sliding_window else True)
    if attention_mask.dtype == torch.bool:
        return attention_mask[..., -n:]
    return attention_mask[..., -n:] > torch.finfo(attention_mask.dtype).min / 2


CAP_ON = [True]


@pytest.fixture(scope="module", autouse=True)
def _registered():
    from transformers import AttentionInterface

    AttentionInterface.register(REFERENCE, _reference)


def _ids(model, length=11, seed=1):
    return torch.randint(3, 100, (2, length), generator=torch.Generator().manual_seed(seed))


KINDS = ["gemma4_kv_shared", "gemma4_k_eq_v", "gemma3n_text"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_tiny_models_have_the_layers_in_question(kind):
    model = _build(kind)
    lacks = _lacks(model)
    if kind == "gemma4_k_eq_v":
        assert (True, False) in lacks and (True, True) in lacks  # global layers take their values from their keys
    else:  # a shared tail (older releases' Gemma 3n builds k/v projections there and reads the cache instead)
        assert any(getattr(layer.self_attn, "is_kv_shared_layer", False) for layer in model.model.layers)
        assert not getattr(model.model.layers[0].self_attn, "is_kv_shared_layer", True)


@pytest.mark.parametrize("kind", KINDS)
def test_the_reference_is_the_model(kind):
    """The test's attention function, uncapped, computes what Transformers' eager attention computes."""
    model = _build(kind)
    ids = _ids(model)
    with torch.no_grad():
        eager = model(ids).logits
        model.set_attn_implementation(REFERENCE)
        CAP_ON[0] = False
        try:
            ours = model(ids).logits
        finally:
            CAP_ON[0] = True
    torch.testing.assert_close(ours, eager, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", KINDS)
def test_own_norms_kept_change_nothing(kind):
    """``qk_norm`` / rmsnorm takes the places of the model's own q/k norms with their gains: the logits to the bit
    (in float32: Gemma's own norms compute in float32 whatever the model's dtype, the scheme's in the model's)."""
    model = _build(kind, torch.float32)
    ids = _ids(model)
    with torch.no_grad():
        before = model(ids).logits
    hf_qknorm.patch_model(model, scheme="qk_norm", norm="rmsnorm")
    with torch.no_grad():
        after = model(ids).logits
    if any(map(all, _lacks(model))) and not all(map(all, _lacks(model))):
        assert torch.equal(after, before)
    else:  # older releases' Gemma 3n norm divides by the root where the scheme's multiplies: float32's rounding
        torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    attns = [layer.self_attn for layer in model.model.layers]
    assert all(sorted(a.__dict__["_qknorm_norms"]) == (["k", "q"] if k else ["q"]) for a, (k, _) in
               zip(attns, _lacks(model)))  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_the_cap_reaches_every_layer(kind):
    """``qk_norm_cap``: every layer, KV-shared or not, computes capped attention over the keys its store layer
    normalised -- the reference model with the cap in its attention function, to float64 precision; and greedy
    decoding with a cache gives the reference's."""
    model, reference = _build(kind), _build(kind)
    reference.set_attn_implementation(REFERENCE)
    hf_qknorm.patch_model(model, scheme="qk_norm_cap", norm="rmsnorm", softcap=CAP)
    ids = _ids(model)
    with torch.no_grad():  # Gemma's own norms in the reference compute in float32: float32's resolution
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
        cached = model.generate(ids, max_new_tokens=6, do_sample=False)
        expected = reference.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(cached, expected)


@pytest.mark.parametrize("kind", KINDS)
def test_a_patched_model_saves_and_loads(kind, tmp_path):
    model = _build(kind)
    hf_qknorm.patch_model(model, scheme="qk_norm_cap", norm="layernorm", softcap=CAP)
    ids = _ids(model)
    with torch.no_grad():
        before = model(ids).logits
    model.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, before, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_qkv_norm_is_refused_in_one_line(kind):
    model = _build(kind)
    with pytest.raises(UnsupportedModelError, match="normalises v itself"):
        hf_qknorm.patch_model(model, scheme="qkv_norm")
    assert not hf_qknorm.is_patched(model)


def test_keys_changed_between_the_store_layer_and_the_reusing_one_are_refused():
    """A model that hands a KV-shared layer keys other than the ones its store layer normalised (here a hook doubling
    them on the way) would run that layer on unnormalised keys: the self-check refuses it, the model left as it was."""
    model = _build("gemma4_kv_shared")
    shared = model.model.layers[2].self_attn

    def doubled(module, args, kwargs):
        states = kwargs.get("shared_kv_states")
        if states is not None:
            kind = module.layer_type
            if kind in states:
                k, v = states[kind]
                states = dict(states)
                states[kind] = (2 * k, v)
                kwargs["shared_kv_states"] = states
        return args, kwargs

    shared.register_forward_pre_hook(doubled, with_kwargs=True)
    with pytest.raises(UnsupportedModelError, match="layer 2 has no k norm of its own"):
        hf_qknorm.patch_model(model, scheme="qk_norm_cap", softcap=CAP)
    assert not hf_qknorm.is_patched(model)


def test_a_model_whose_own_norms_cannot_take_the_scheme_is_refused():
    """Layers without a key projection in a model that does not normalise q and k itself: the scheme would need a
    key norm there, and there is no key projection to put it on -- refused in one line, before anything changes."""
    model = small_model("llama")
    del model.model.layers[1].self_attn.k_proj
    with pytest.raises(UnsupportedModelError, match="no key or value projection of their own"):
        hf_qknorm.patch_model(model, scheme="qk_norm")
    assert not hf_qknorm.is_patched(model)


def test_qk_clip_bounds_a_kv_shared_layer_through_its_query_gain():
    """QK-Clip on the KV-shared model: a layer that reuses keys has only its query gain to scale, which takes the
    whole factor; every layer's logits end at or below tau (measured by the reference attention)."""
    seen = {}

    def measure(module, query, key, value, attention_mask, scaling=None, **kwargs):
        groups = query.shape[1] // key.shape[1]
        s = (scaling or 1.0) * query.double() @ key.double().repeat_interleave(groups, 1).transpose(-1, -2)
        allowed = _allowed(s, attention_mask, kwargs.get("sliding_window"))
        seen[module.layer_idx] = s.masked_fill(~allowed, float("-inf")).amax().item()
        return _reference(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    from transformers import AttentionInterface

    AttentionInterface.register("kv_shared_test_measure", measure)
    model = _build("gemma4_kv_shared")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.mul_(4.0)
    hf_qknorm.patch_model(model, scheme="qk_norm", norm="rmsnorm")
    model.set_attn_implementation("qknorm")
    ids = _ids(model)

    def maxima():
        model.set_attn_implementation("kv_shared_test_measure")
        model.eval()
        with torch.no_grad():
            CAP_ON[0] = False
            try:
                model(ids)
            finally:
                CAP_ON[0] = True
        model.set_attn_implementation("qknorm")
        return dict(seen)

    before = maxima()
    tau = 0.5 * min(before.values())
    clip = hf_qknorm.QKClip(model, tau=tau)
    model.train()
    model(ids)
    assert {i for i, *_ in clip.step()} == set(before)  # every layer, the KV-shared one too, was over tau
    after = maxima()
    assert all(value <= tau * (1 + 1e-9) for value in after.values())
    with pytest.raises(NotImplementedError, match="layer 2 reuses an earlier layer's keys"):
        hf_qknorm.QKLearningRate(model)


def test_the_language_model_of_a_multimodal_gemma4_with_kv_shared_layers():
    """Gemma 4 E2B/E4B are multimodal: their language model's KV-shared tail is patched as a text model's is, the
    logits kept to the bit by ``qk_norm`` / rmsnorm, and verify follows it."""
    _known("gemma4")
    from transformers import AutoModelForImageTextToText

    from hf_qknorm.verification.tiny import tiny_multimodal_config

    config = tiny_multimodal_config("gemma4")
    text = config.get_text_config()
    wide = next(iter(text.to_dict()["per_layer_config"].values()))
    text.num_hidden_layers = 4
    text.layer_types = ["sliding_attention", "full_attention"] * 2
    text.per_layer_config = {1: dict(wide), 3: dict(wide)}
    text.num_kv_shared_layers = 2
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    layers = model.model.language_model.layers
    own_keys = [isinstance(getattr(layer.self_attn, "k_proj", None), nn.Module) for layer in layers]
    assert own_keys == [True, True, False, False]
    ids = _ids(model)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    hf_qknorm.patch_model(model, scheme="qk_norm", norm="rmsnorm")
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)
    assert hf_qknorm.verify(model, generate=False).ok

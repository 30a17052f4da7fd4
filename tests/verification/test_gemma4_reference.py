"""Gemma 4 against the float64 reference: what its attention does that other families' does not, each derived from
Transformers' own classes and checked by an adversary the verifier must catch.

- ``shared_kv_states``, a mapping every attention call takes, which a layer that stores its keys and values only
  writes into (``derive.inert_arguments``); a layer that reads it is not inert;
- a logit scale of 1 built by the class itself (its q/k norms set the logits' size), never read off the instance;
- a per-head v norm without a gain (``v_norm``) in the reference, whatever the scheme does to q and k;
- its rotary function's one-tensor convention, ``apply(x, cos, sin, unsqueeze_dim=2)``.
"""

from __future__ import annotations

import pytest
import torch

import hf_qknorm
from hf_qknorm.verification import derive
from hf_qknorm.verification.layers import ReferenceModel
from hf_qknorm.verification.tiny import tiny_config, tiny_model
from tests._support.tiny_models import kv_shared_gemma4


def _skip_unless_gemma4():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "gemma4_text" not in CONFIG_MAPPING:
        pytest.skip("Gemma 4 is not in this Transformers")


@pytest.mark.parametrize(
    "settings",
    [None, {"scheme": "qk_norm", "norm": "rmsnorm"}, {"scheme": "qk_norm_cap", "norm": "layernorm"}]
    + [{"scheme": "qk_norm", "norm": "l2"}, {"scheme": "soft_cap", "softcap": 5.0}],
    ids=lambda s: "unpatched" if s is None else "-".join(str(v) for v in s.values()),
)
def test_gemma4_verifies_against_float64_in_both_layer_widths(settings):
    _skip_unless_gemma4()
    model = tiny_model("gemma4_text")
    if settings is not None:
        hf_qknorm.patch_model(model, **settings)
    report = hf_qknorm.verify(model, generate=False)
    assert report.ok, str(report)
    ref = ReferenceModel(model)
    specs = [ref.spec(i) for i in range(len(ref))]
    assert sorted({s.head_dim for s in specs}) == sorted({layer.self_attn.head_dim for layer in model.model.layers})
    assert len({s.head_dim for s in specs}) == 2  # a layer of each width was checked
    for spec in specs:
        assert spec.v_own is not None and spec.v_own["weight"] is None and spec.v_own["kind"] == "rmsnorm"
        learned = settings is not None and settings.get("norm") == "l2"
        assert spec.scaling == 1.0, "Gemma 4 scales its logits by 1" if not learned else "l2's scale is the norm's"


def test_a_change_to_gemma4s_own_v_norm_is_caught():
    """A hook doubling what the model's own v norm gives: the reference applies Transformers' norm, so every layer's
    output differs."""
    _skip_unless_gemma4()
    model = tiny_model("gemma4_text")
    hf_qknorm.patch_model(model, scheme="qk_norm_cap", norm="rmsnorm")
    assert hf_qknorm.verify(model, generate=False).ok
    for layer in model.model.layers:
        layer.self_attn.v_norm.register_forward_hook(lambda module, args, out: 2 * out)
    report = hf_qknorm.verify(model, generate=False)
    assert not report.ok, str(report)


def test_a_scale_of_1_is_taken_from_the_class_never_from_the_instance():
    """A Qwen3 whose attention modules were set to a scale of 1 computes other logits than Qwen3 does: the
    reference keeps the class's ``head_dim ** -0.5`` (Gemma 4's class builds 1 itself), so the change is caught."""
    model = tiny_model("qwen3")
    assert hf_qknorm.verify(model, generate=False).ok
    for layer in model.model.layers:
        assert layer.self_attn.scaling != 1.0
        layer.self_attn.scaling = 1.0
    assert derive.built_scaling(model.model.layers[0].self_attn, model.config, 0) != 1.0
    report = hf_qknorm.verify(model, generate=False)
    assert not report.ok, str(report)


def test_only_a_layer_that_writes_shared_kv_states_and_never_reads_it_leaves_it_out():
    """In a Gemma 4 whose last layer reuses the keys and values an earlier layer stored, the storing layer only
    writes ``shared_kv_states`` (inert), the reusing layer reads it (not inert: its source layer is derived)."""
    _skip_unless_gemma4()
    from collections.abc import MutableMapping

    model = kv_shared_gemma4()
    attns = [layer.self_attn for layer in model.model.layers]
    assert [a.store_full_length_kv for a in attns] == [True, True, False] and attns[2].is_kv_shared_layer
    found = [derive.inert_arguments(a, model.config, i, ["shared_kv_states"]) for i, a in enumerate(attns)]
    assert [set(f) for f in found] == [{"shared_kv_states"}] * 2 + [set()]
    assert issubclass(found[0]["shared_kv_states"], MutableMapping)  # KVSharingDict on 5.2x, a dict before


def test_an_argument_declared_as_no_mapping_is_never_taken_for_inert():
    """An argument that changes nothing when given a mapping may still act when the model gives it a tensor: only
    one the forward declares a mutable mapping is probed."""
    _skip_unless_gemma4()
    model = tiny_model("gemma4_text")
    attn = model.model.layers[0].self_attn
    base = type(attn)

    class Undeclared(base):
        def forward(self, hidden_states, position_embeddings, attention_mask, shared_kv_states, scale=None, **kwargs):
            if isinstance(scale, torch.Tensor):
                hidden_states = hidden_states * scale
            return super().forward(hidden_states, position_embeddings, attention_mask, shared_kv_states, **kwargs)

    Undeclared.__module__ = base.__module__
    for layer in model.model.layers:
        layer.self_attn.__class__ = Undeclared
    assert derive.inert_arguments(attn, model.config, 0, ["scale", "shared_kv_states"]) == {}
    assert set(derive.unmodelled_arguments(attn)) == {"scale", "shared_kv_states"}
    with pytest.raises(
        hf_qknorm.UnsupportedModelError, match="does not model the scale, shared_kv_states argument of Undeclared"
    ):
        hf_qknorm.verify(model, generate=False)


def test_the_one_tensor_rotary_convention_is_read():
    """Gemma 4 rotates one ``(batch, seq, heads, dim)`` tensor at a time with ``unsqueeze_dim=2``: its layout is
    read as Llama's half split."""
    _skip_unless_gemma4()
    model = tiny_model("gemma4_text")
    attn = model.model.layers[0].self_attn
    x = torch.zeros(1, 5, model.config.hidden_size)
    cos, sin = model.model.rotary_emb(x, torch.arange(5)[None], layer_type="sliding_attention")
    assert derive.rope_layout(attn, "gemma4_text", cos, sin, attn.head_dim) == ("half", False)


def test_gemma4_unified_checks_text_where_only_image_tokens_attend_both_ways():
    """Gemma 4 Unified's ``use_bidirectional_attention="vision"`` builds causal attention modules (image tokens
    attend both ways among themselves): on text, which the probes feed, it verifies; ``"all"`` (non-causal modules)
    is refused in one line, as PaliGemma's ``True`` is."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "gemma4_unified_text" not in CONFIG_MAPPING:
        pytest.skip("Gemma 4 Unified is not in this Transformers")
    model = tiny_model("gemma4_unified_text")
    assert model.config.use_bidirectional_attention == "vision"
    hf_qknorm.patch_model(model, scheme="qk_norm_cap", norm="rmsnorm")
    assert hf_qknorm.verify(model, generate=False).ok
    config = tiny_config("gemma4_unified_text")
    config.use_bidirectional_attention = "all"
    from transformers import AutoModelForCausalLM

    both_ways = AutoModelForCausalLM.from_config(config).eval()
    assert not both_ways.model.layers[0].self_attn.is_causal
    with pytest.raises(hf_qknorm.UnsupportedModelError, match="cannot model use_bidirectional_attention"):
        hf_qknorm.verify(both_ways, generate=False)

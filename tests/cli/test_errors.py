"""Bad input gets a clear error naming the value and the valid choices."""

from __future__ import annotations

import pytest
import torch

import hf_qknorm
from hf_qknorm import QKNormConfig
from tests._support.tiny_models import VOCAB, tiny_model


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"scheme": "qk_nrom"}, r"unknown scheme 'qk_nrom'.*'qk_norm', 'soft_cap', 'qk_norm_cap', 'qkv_norm'"),
        ({"scheme": "qk_norm", "norm": "batchnorm"}, r"unknown norm 'batchnorm'.*'layernorm', 'rmsnorm', 'l2', 'lp'"),
        ({"scheme": "qk_norm_cap", "softcap": 0}, r"softcap must be a positive finite number up to 1e\+06, got 0"),
        ({"scheme": "qk_norm_cap", "softcap": 1e39}, r"got 1e\+39"),  # inf in float32: every logit would be NaN
        ({"scheme": "qk_norm_cap", "softcap": True}, r"got True"),
        ({"scheme": "qk_norm", "eps": True}, r"eps must be a positive finite number, got True"),
        ({"scheme": "qk_norm", "norm": "lp", "p": True}, r"p must be a finite number >= 1 for norm 'lp', got True"),
        ({"scheme": "qk_norm_cap", "softcap": -5.0}, r"got -5.0"),
        ({"scheme": "soft_cap", "softcap": float("inf")}, r"got inf"),
        ({"scheme": "qk_norm", "softcap": 30.0}, r"scheme 'qk_norm' has no cap.*capped schemes"),
        ({"scheme": "soft_cap", "norm": "rmsnorm"}, r"'soft_cap' has no norm"),
        ({"scheme": "qk_norm", "norm": "lp"}, r"norm 'lp' needs an exponent p"),
        ({"scheme": "qk_norm", "norm": "lp", "p": 0.5}, r"p must be a finite number >= 1.*got 0.5"),
        ({"scheme": "qk_norm", "norm": "rmsnorm", "p": 3}, r"p=3 only applies to norm 'lp'"),
        ({"scheme": "qk_norm", "norm": "l2", "p": 3}, r"norm 'l2' is the Lp norm with p=2"),
        ({"scheme": "qk_norm", "eps": -1e-6}, r"eps must be a positive finite number"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QKNormConfig(**kwargs)


def test_defaults():
    assert QKNormConfig().softcap == 50.0 and QKNormConfig().norm == "layernorm"
    assert QKNormConfig("soft_cap").norm is None
    assert QKNormConfig("qk_norm", norm="l2").p == 2.0
    with pytest.raises(ValueError, match=r"unknown keys in config.qknorm: \['cap'\]"):
        QKNormConfig.from_dict({"scheme": "qk_norm", "cap": 3})


def test_patch_errors_are_clear():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="unknown scheme"):
        hf_qknorm.patch_model(model, "qknorm")
    hf_qknorm.patch_model(model, "qk_norm")
    with pytest.raises(ValueError, match="already patched"):
        hf_qknorm.patch_model(model, "qk_norm_cap")


def test_unsupported_models():
    from transformers import BertConfig, BertModel

    bert = BertModel(
        BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    )
    with pytest.raises(hf_qknorm.UnsupportedModelError, match=r"model type 'bert' is an encoder model"):
        hf_qknorm.patch_model(bert)
    with pytest.raises(TypeError, match="expected a Transformers model"):
        hf_qknorm.patch_model(torch.nn.Linear(2, 2))


def test_cap_is_never_dropped():
    """A capped model is moved off sdpa/eager, and refuses to run if moved back."""
    for impl in ("sdpa", "eager"):
        model = tiny_model("llama", attn_implementation=impl)
        hf_qknorm.patch_model(model, "qk_norm_cap")
        assert model.config._attn_implementation == "qknorm"
        model.set_attn_implementation(impl)
        with pytest.raises(ValueError, match=rf"attention implementation '{impl}' cannot apply the softcap"):
            model(torch.randint(0, VOCAB, (1, 5)))
    moved = tiny_model("llama", attn_implementation="sdpa")
    hf_qknorm.patch_model(moved, "soft_cap")
    moved.config._attn_implementation = "eager"  # set on the config directly, not through the model
    with pytest.raises(ValueError, match=r"attention implementation 'eager' cannot apply the softcap"):
        moved(torch.randint(0, VOCAB, (1, 5)))
    plain = tiny_model("llama")
    hf_qknorm.patch_model(plain, "qk_norm")
    assert plain.config._attn_implementation == "sdpa"  # nothing to cap: the fastest backend stays


def test_qknorm_attention_rejects_bias_masks():
    from hf_qknorm.attention.interface import qknorm_attention_forward

    q = torch.randn(1, 2, 4, 8)
    bias = torch.randn(1, 1, 4, 4)  # a position bias, not a mask: would be dropped
    with pytest.raises(ValueError, match="additive masks of 0 and -inf only"):
        qknorm_attention_forward(torch.nn.Module(), q, q, q, bias, softcap=5.0)
    for cap in (-1, 0.0, 1e39, float("nan"), True):  # any model may hand the backend a cap: Gemma 2's config does
        with pytest.raises(ValueError, match=r"softcap must be a positive finite number up to 1e\+06"):
            qknorm_attention_forward(torch.nn.Module(), q, q, q, None, softcap=cap)


@pytest.mark.parametrize(
    "entry,match",
    [
        ({}, r"lacks \['scheme', 'norm', 'softcap', 'eps', 'p'\]"),
        ({"scheme": "qk_norm_cap", "norm": "layernorm", "eps": 1e-6, "p": None}, r"lacks \['softcap'\]"),
        (
            {"scheme": "qk_norm_cap", "norm": "layernorm", "softcap": None, "eps": 1e-6, "p": None},
            r"softcap=None, but scheme 'qk_norm_cap' .* means softcap=50.0",
        ),
        ({"scheme": "qk_norm", "norm": "layernorm", "softcap": None, "eps": None, "p": None}, r"eps null"),
        ({"scheme": "soft_cap", "norm": None, "softcap": 0, "eps": 1e-6, "p": None}, r"softcap must be .* got 0"),
        ({"scheme": "qk_norm_capp", "norm": None, "softcap": 5.0, "eps": 1e-6, "p": None}, r"unknown scheme"),
        ({"scheme": "qk_norm", "norm": "layernorm", "softcap": None, "eps": 1e-6, "p": None, "gain": 2}, r"'gain'"),
        ([("scheme", "qk_norm")], r"config.qknorm must be a dict"),
    ],
)
def test_saved_scheme_entries_are_not_trusted(entry, match, tmp_path):
    """A saved config.qknorm is validated with the same rules, and nothing is filled in from defaults: a missing
    softcap must not load with cap 50. The same check runs in the remote code (it is the same module)."""
    with pytest.raises(ValueError, match=match):
        QKNormConfig.from_dict(entry)
    model = tiny_model("llama")
    hf_qknorm.patch_model(model, "qk_norm_cap")
    model.save_pretrained(tmp_path)
    import json

    from transformers import AutoModelForCausalLM

    data = json.loads((tmp_path / "config.json").read_text())
    data["qknorm"] = entry
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match):
        AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm", "l2", "lp"])
def test_an_eps_that_vanishes_in_float32_is_refused(norm, tmp_path):
    """Norms compute in float32 for float32 and half-precision models: eps=1e-300 became 0 there and a zero query
    gave NaN logits (issue 22). An eps below float32's smallest normal number is refused wherever it comes from --
    given, the model's own norm epsilon, a saved config.qknorm; at that smallest eps a zero vector stays finite."""
    p = 3.0 if norm == "lp" else None
    with pytest.raises(ValueError, match=r"eps must be .* at least 1\.18e-38 .* got 1e-300"):
        QKNormConfig("qk_norm", norm=norm, eps=1e-300, p=p)
    with pytest.raises(ValueError, match=r"got 1e-300 \(the model's own rms_norm_eps\)"):
        hf_qknorm.patch_model(tiny_model("llama", rms_norm_eps=1e-300), "qk_norm", norm=norm, p=p)
    entry = {"scheme": "qk_norm", "norm": norm, "softcap": None, "eps": 1e-300, "p": 2.0 if norm == "l2" else p}
    with pytest.raises(ValueError, match=r"got 1e-300"):
        QKNormConfig.from_dict(entry)

    tiny = torch.finfo(torch.float32).tiny
    model = tiny_model("llama")
    hf_qknorm.patch_model(model, "qkv_norm", norm=norm, p=p, eps=tiny)
    attn = model.model.layers[0].self_attn
    for dtype in (torch.float32, torch.bfloat16):
        zero = torch.zeros(2, 3, 16, dtype=dtype)
        for module in (attn.q_norm, attn.k_norm, attn.v_norm):
            assert torch.isfinite(module.to(dtype)(zero)).all(), (module, dtype)
    ids = torch.randint(0, VOCAB, (1, 6))
    model.to(torch.float32).model.embed_tokens.weight.data[ids[0, 2]] = 0.0  # a zero query and key (no pre-norm)
    assert torch.isfinite(model(ids).logits).all()

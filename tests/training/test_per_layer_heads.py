"""A model whose attention modules are built with their own head counts, not the config's (Laguna's
``num_attention_heads_per_layer``): every per-head control reads each layer's own count off the module.

Before, the head count came from ``config.num_attention_heads`` alone: on a Laguna whose layers have 8 and 6 query
heads where the config says 4, the per-head Q/K learning rates covered 4 heads' rows of each layer and left the rest
at the base step (silently), QK-Clip crashed on the kernel's per-head maxima, and ``verify`` could not build the
layer.
"""

from __future__ import annotations

import pytest
import torch

import hf_qknorm
from hf_qknorm.portable.families import heads_of
from hf_qknorm.training.qk_lr import QKLearningRate
from hf_qknorm.verification.loading import quiet_transformers

PER_LAYER = [8, 6]  # query heads of the two layers; the config's num_attention_heads says 4


def _laguna(dtype=torch.float64):
    transformers = pytest.importorskip("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "laguna" not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no Laguna")
    from hf_qknorm.verification.tiny import tiny_config

    config = tiny_config("laguna")
    config.num_hidden_layers = len(PER_LAYER)
    config.num_attention_heads_per_layer = list(PER_LAYER)
    config.layer_types = ["full_attention"] * len(PER_LAYER)
    if hasattr(config, "mlp_layer_types"):
        config.mlp_layer_types = ["dense"] * len(PER_LAYER)
    torch.manual_seed(0)
    with quiet_transformers():
        model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    assert config.num_attention_heads not in PER_LAYER
    return model


def test_each_layer_reads_its_own_head_count():
    model = _laguna()
    for layer, want in zip(model.model.layers, PER_LAYER):
        attn = layer.self_attn
        assert attn.q_proj.weight.shape[0] == want * attn.head_dim  # the module is built that way
        assert heads_of(attn, model.config) == (want, model.config.num_key_value_heads)


def test_per_head_learning_rates_cover_every_head():
    model = _laguna()
    hf_qknorm.patch_model(model, "qk_norm")
    qk = QKLearningRate(model.train(), tau=0.5)
    attn = model.model.layers[0].self_attn
    group = PER_LAYER[0] // model.config.num_key_value_heads  # query heads per key head
    with torch.no_grad():  # the second key head's query heads, all beyond the config's 4, grow x4
        attn.q_proj.weight[group * attn.head_dim :] *= 4.0
    fq, fk = qk.factors()[0]
    assert fq.shape == (PER_LAYER[0],) and fk.shape == (model.config.num_key_value_heads,)
    # the rule: a key head's rate is tau times its query heads' largest norm at the start over their largest now
    torch.testing.assert_close(fk, torch.tensor([0.5, 0.5 / 4], dtype=torch.float64))


def test_qk_clip_reads_every_heads_maximum():
    model = _laguna()
    model.set_attn_implementation("qknorm")
    clip = hf_qknorm.QKClip(model.train(), tau=1e-3)  # every head is above it
    ids = torch.randint(1, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    model(ids)
    assert [m.numel() for m in clip.maxima] == PER_LAYER
    assert all(bool(torch.isfinite(m).all()) for m in clip.maxima)
    clipped = clip.step()
    assert sorted({layer for layer, *_ in clipped}) == [0, 1]
    assert max(h for layer, h, *_ in clipped if layer == 0) >= 4  # heads the config's count does not have


@pytest.mark.parametrize("scheme", [None, "qk_norm_cap"])
def test_verify_builds_each_layer_with_its_head_count(scheme):
    model = _laguna(torch.float32)
    if scheme is not None:
        hf_qknorm.patch_model(model, hf_qknorm.QKNormConfig(scheme, norm="rmsnorm"))
    report = hf_qknorm.verify(model, generate=False)
    assert report.ok, str(report)

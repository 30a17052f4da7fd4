"""The calibration's activation recorder runs the original model as it is: whatever it puts in place of the scheme's
norms to read their inputs must hand on what the original computes there. A model with a norm of its own in a slot
the scheme does not replace (Gemma 4's and Gemma 3n's gain-free ``v_norm``) must keep calling it, and each role
must be read once per call; a layer that reuses another layer's keys and values has only its queries to read."""

from __future__ import annotations

import pytest
import torch

from hf_qknorm import QKNormConfig
from hf_qknorm.conversion.calibration.stats import ActivationRecorder
from hf_qknorm.portable.families import family_of_model
from tests._support.tiny_models import kv_shared_gemma4, tiny_model


def _gemma4():
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from hf_qknorm.verification.tiny import tiny_config

    if "gemma4_text" not in CONFIG_MAPPING:
        pytest.skip("gemma4_text is not in this Transformers")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("gemma4_text")).eval()


def _kv_shared():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "gemma4_text" not in CONFIG_MAPPING:
        pytest.skip("gemma4_text is not in this Transformers")
    return kv_shared_gemma4()


BUILDERS = {"llama": lambda: tiny_model("llama"), "gemma4_text": _gemma4, "gemma4_kv_shared": _kv_shared}


@pytest.mark.parametrize("kind", sorted(BUILDERS))
@pytest.mark.parametrize("scheme, norm", [("qk_norm", "l2"), ("qk_norm_cap", "layernorm")])
def test_the_recorder_leaves_the_forward_as_it_is_and_reads_each_role_once(kind, scheme, norm):
    model = BUILDERS[kind]()
    model.set_attn_implementation("qknorm")  # the recorder reads the logits off this backend
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    layers = list(range(model.config.num_hidden_layers))
    cfg = QKNormConfig(scheme=scheme, norm=norm, eps=1e-6, softcap=30.0 if scheme.endswith("cap") else None)
    recorder = ActivationRecorder(model, family_of_model(model), cfg, torch.device("cpu"), layers)
    with torch.no_grad(), recorder:
        during = model(ids).logits
    assert torch.equal(during, before)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)  # and everything put back
    for j, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        q_heads = attn.q_proj.weight.shape[0] // attn.head_dim
        assert recorder.moments[j]["q"].count == ids.numel() * q_heads  # every query head of every token, once
        k_proj = getattr(attn, "k_proj", None)
        kv_heads = 0 if k_proj is None else k_proj.weight.shape[0] // attn.head_dim
        assert recorder.moments[j]["k"].count == ids.numel() * kv_heads  # none where the keys are another layer's
        v_proj = getattr(attn, "v_proj", None)
        assert recorder.moments[j]["v"].count == (0 if v_proj is None else ids.numel() * kv_heads)

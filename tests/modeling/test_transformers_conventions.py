"""Transformers conventions a patched model keeps (found by running Transformers' common tests on patched models,
``tests/transformers_suite``): a loaded ``QKNorm<Head>`` is still recognised as its head where Transformers goes by
class name, and ``config.output_attentions`` returns attention weights on a capped model as the forward's
``output_attentions=True`` does."""

from __future__ import annotations

import math

import pytest
import torch

import hf_qknorm
from tests._support.tiny_models import FAMILY_NAMES, VOCAB, tiny_model


def _saved(tmp_path, scheme, **settings):
    model = tiny_model("llama", seed=1)
    hf_qknorm.patch_model(model, scheme, **settings)
    model.save_pretrained(tmp_path)
    return model


def _smoothed_loss(logits, labels, eps):
    """Label-smoothed cross-entropy of next-token prediction, from the formula (float64): position t predicts
    label t+1; (1 - eps) * NLL + eps * mean over the vocabulary of -log p."""
    logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    target = labels[:, 1:]
    nll = -logp.gather(-1, target[..., None]).squeeze(-1).mean()
    uniform = -logp.mean(-1).mean()
    return (1 - eps) * nll + eps * uniform


def test_trainer_label_smoothing_shifts_the_labels_of_a_loaded_patched_model(tmp_path):
    # Trainer decides by the model's name whether it is a causal LM whose labels must be shifted for label
    # smoothing; a folder loaded as QKNormLlamaForCausalLM must be treated like LlamaForCausalLM.
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    _saved(tmp_path / "m", "qk_norm")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert type(loaded).__name__ == "QKNormLlamaForCausalLM"
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), label_smoothing_factor=0.1, report_to="none", use_cpu=True
    )
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    trainer = Trainer(model=loaded, args=args)
    with torch.no_grad():
        loss = trainer.compute_loss(loaded, {"input_ids": ids, "labels": ids.clone()})
        logits = loaded(ids).logits
    torch.testing.assert_close(loss.double(), _smoothed_loss(logits, ids, 0.1), rtol=1e-5, atol=1e-6)


def test_config_output_attentions_returns_weights_on_a_capped_model(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _saved(tmp_path, "qk_norm_cap", softcap=2.0).eval()
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids, output_attentions=True).attentions
    assert len(expected) == 2

    # set while loading (Transformers chooses eager for it; the patch moves the capped model to "qknorm")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, output_attentions=True).eval()
    assert loaded.config._attn_implementation == "qknorm"
    # set on a loaded model's config (Transformers' own rule allows it only on eager, which cannot cap)
    later = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    later.config.output_attentions = True
    for m in (loaded, later):
        with torch.no_grad():
            got = m(ids).attentions
            off = m(ids, output_attentions=False).attentions
        assert len(got) == 2 and off is None
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e)
            torch.testing.assert_close(g.sum(-1), torch.ones_like(g.sum(-1)))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_output_attentions_returns_weights_on_every_family(family):
    """``output_attentions=True`` returns one weight tensor per layer on the "qknorm" backend, for every family and
    for the base model as for the LM head (GPT-2 does not pass the argument on to its attention: the backend follows
    Transformers' output capture). The weights are probabilities of capped logits: with the cap c every allowed
    logit lies in (-c, c), so within a row no weight exceeds another by more than exp(2c)."""
    cap = 2.0
    model = tiny_model(family, dtype=torch.float64)
    hf_qknorm.patch_model(model, "qk_norm_cap", softcap=cap)
    with torch.no_grad():  # logits far beyond the cap
        for name, prm in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                prm.mul_(8)
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        for head in (model, model.base_model):
            weights = head(ids, attention_mask=mask, output_attentions=True).attentions
            assert weights is not None and len(weights) == 2, (family, type(head).__name__)
            w = weights[-1]
            assert w.shape == (2, 4, 6, 6)
            torch.testing.assert_close(w.sum(-1)[:, :, 2:], torch.ones(2, 4, 4, dtype=w.dtype))
            assert torch.all(w[0, :, :, :2] == 0) and torch.all(w.triu(1) == 0)  # padding, causality
            allowed = torch.ones(6, 6, dtype=torch.bool).tril()[None, None] & mask.bool()[:, None, None, :]
            rows = allowed.expand_as(w).any(-1)
            ratio = (w.masked_fill(~allowed, 0).amax(-1) / w.masked_fill(~allowed, 2).amin(-1))[rows]
            assert ratio.max() <= math.exp(2 * cap) * (1 + 1e-9)
            assert ratio.max() > 0.9 * math.exp(2 * cap)  # the cap bites: some rows are saturated


def test_output_attentions_stays_refused_where_no_weights_come_back(tmp_path):
    # An uncapped patched model on sdpa returns no weights: Transformers' refusal is kept there.
    from transformers import AutoModelForCausalLM

    _saved(tmp_path, "qk_norm")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    with pytest.raises(ValueError, match="output_attentions"):
        loaded.config.output_attentions = True


def _patched_config(family, scheme, **settings):
    from hf_qknorm import get_family
    from hf_qknorm.modeling.classes import config_class
    from tests._support.tiny_models import tiny_config

    base = tiny_config(family)
    eps = float(get_family(family).norm_eps(base))
    qknorm = hf_qknorm.QKNormConfig(scheme, eps=eps, **settings).to_dict()
    return config_class(family)(**base.to_dict(), qknorm=qknorm)


@pytest.mark.parametrize("norm,settings", [("lp", {"p": 3.0}), ("l2", {}), ("layernorm", {}), ("rmsnorm", {})])
def test_a_checkpoint_without_the_norms_is_refused_and_trained_norms_round_trip(tmp_path, norm, settings):
    """A plain checkpoint loaded into a patched class has no norm weights: refused, naming them (issue 22; it used
    to load with fresh norms -- and for qkv_norm without the pre-attention norm's gain, which only patch_model and
    convert fold). patch_model gives the same structure with initial values (the lp/l2 logit scale at Henry et al.'s
    log2(L^2 - L), value scales and gains at 1, biases at 0), and trained norm weights survive a save/load round
    trip bit for bit."""
    from transformers import AutoModelForCausalLM

    from hf_qknorm.portable.norms import henry_logit_scale
    from hf_qknorm.portable.weights import SchemeWeightsError

    tiny_model("llama", seed=2).save_pretrained(tmp_path / "plain")
    config = _patched_config("llama", "qkv_norm", norm=norm, **settings)
    with pytest.raises(SchemeWeightsError, match=r"missing .*q_norm.weight.*unexpected .*input_layernorm.weight"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "plain", config=config)

    loaded = hf_qknorm.patch_model(
        AutoModelForCausalLM.from_pretrained(tmp_path / "plain"), "qkv_norm", norm=norm, **settings
    )
    attn = loaded.model.layers[1].self_attn
    scale = henry_logit_scale(config.max_position_embeddings)
    q_expected = torch.full_like(attn.q_norm.weight, scale if norm in ("l2", "lp") else 1.0)
    torch.testing.assert_close(attn.q_norm.weight, q_expected, rtol=0, atol=0)
    torch.testing.assert_close(attn.v_norm.weight, torch.ones_like(attn.v_norm.weight), rtol=0, atol=0)
    if norm == "layernorm":
        assert torch.all(attn.q_norm.bias == 0) and torch.all(attn.v_norm.bias == 0)

    with torch.no_grad():  # trained norm weights survive a save/load round trip untouched
        for name, prm in loaded.named_parameters():
            if "_norm." in name:
                prm.add_(torch.randn_like(prm))
    loaded.save_pretrained(tmp_path / "patched")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "patched")
    for (name, a), b in zip(loaded.state_dict().items(), again.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("head", ["GPT2Model", "GPT2LMHeadModel"])
def test_patched_gpt2_is_initialised_like_gpt2(head):
    """GPT-2 scales the init of each residual projection (c_proj) by 1/sqrt(2 n_layer), a rule of its attention and
    MLP modules. A patched GPT-2 built fresh or with every weight but the norms missing gets the same weights as
    plain GPT-2 from the same seed (besides the new norms)."""
    import transformers

    base_cls = getattr(transformers, head)
    from hf_qknorm.modeling.classes import model_class
    from tests._support.tiny_models import tiny_config

    patched_cls = model_class(base_cls, "gpt2")
    config = _patched_config("gpt2", "qk_norm_cap")
    builds = {
        "plain": lambda: base_cls(tiny_config("gpt2")),
        "fresh": lambda: patched_cls(config),
        # every weight missing but the norms (a checkpoint without them is refused)
        "missing": lambda: patched_cls.from_pretrained(None, config=config, state_dict=norms),
    }
    norms = {k: v for k, v in patched_cls(config).state_dict().items() if "_norm." in k}
    states = {}
    for name, build in builds.items():
        torch.manual_seed(0)
        states[name] = {k: v for k, v in build().state_dict().items() if "_norm." not in k}
    # (Transformers 5.23 scales c_proj: std 0.02 / sqrt(2 * 2) = 0.01; 5.4 does not)
    for name in ("fresh", "missing"):
        for key, value in states["plain"].items():
            if key.endswith("c_proj.weight"):
                torch.testing.assert_close(states[name][key].std(), value.std(), rtol=0.25, atol=0, msg=f"{name} {key}")
    for key, value in states["plain"].items():
        torch.testing.assert_close(states["fresh"][key], value, rtol=0, atol=0, msg=key)

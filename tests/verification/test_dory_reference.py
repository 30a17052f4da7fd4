"""Dory (a looped nGPT: input layers, recurrent layers run in loops, output layers) against the float64 reference.

What the reference derives for it, each held against something it did not compute: its q/k norms onto the unit
sphere (``x / sqrt(sum x^2 + eps)``, by hand); the factor ``sqk`` puts on the rotated query (Dory's own formula,
``(sqk * sqk_scale) ** 2``); each loop of a recurrent layer checked on its own calls; ``cache_offset`` (where each
loop keeps its cache) and ``shared_kv_states`` (given only where the loops share one cache). Adversaries: a
computing model whose query factor, second loop or cache slots differ from what its weights and config say."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_qknorm
from hf_qknorm import UnsupportedModelError
from hf_qknorm.portable.families import family_of_model
from hf_qknorm.portable.layout import find_layers
from hf_qknorm.reference import norm_reference
from hf_qknorm.verification import checks, derive, layers, probe
from hf_qknorm.verification.loading import quiet_transformers
from hf_qknorm.verification.tiny import tiny_config

SCHEMES = [None, "soft_cap", "qk_norm_cap", "qkv_norm"]


def _dory(scheme=None, **settings):
    """A tiny Dory (one input, one recurrent and one output layer, two loops), patched with ``scheme`` (rmsnorm),
    its ``sqk`` and norm gains moved off their init so that the reference must read them."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "dory" not in CONFIG_MAPPING:
        pytest.skip("Dory is not in this Transformers")
    config = tiny_config("dory")
    for name, value in settings.items():
        setattr(config, name, value)
    with quiet_transformers():
        model = AutoModelForCausalLM.from_config(config).eval()
    if scheme is not None:
        hf_qknorm.patch_model(model, scheme, norm=None if scheme == "soft_cap" else "rmsnorm")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if name.endswith("sqk") or (prm.dim() == 1 and "norm" in name):
                prm.mul_(1 + 0.3 * torch.randn(prm.shape, generator=gen))
    return model


def _attns(model):
    family = family_of_model(model)
    return [getattr(b, family.attention) for b in find_layers(model, family)]


def _judge(reference_model, computing_model):
    """The report of ``computing_model``'s probes (cached generation too) against ``reference_model``'s reference."""
    ref = layers.ReferenceModel(reference_model)
    return checks.build_report(ref, probe.run_probes(computing_model, ref.plan()))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_dory_verifies_every_loop_of_its_recurrent_layers(scheme):
    model = _dory(scheme)
    report = hf_qknorm.verify(model)
    assert report.ok, str(report)
    recurrent = model.config.n_input_layers
    rows = {c.probe for c in report.checks if c.layer == recurrent}
    loops = {"unpadded loop 1", "padded loop 1", "cache-unpadded loop 1", "cache-padded loop 1"}
    assert loops <= rows, rows
    assert not any("loop" in c.probe for c in report.checks if c.layer != recurrent)


def test_the_unit_sphere_norm_is_read_as_an_rms_norm():
    """``DoryL2Norm`` has no parameters; the reference reads it as an RMS norm with the gain ``1/sqrt(d)`` and the
    epsilon ``eps / d``, which must give ``x / sqrt(sum x^2 + eps)`` (written here by hand)."""
    model = _dory()
    attn = _attns(model)[0]
    head_dim = attn.head_dim
    own = derive.own_norm(attn.q_norm, "the q norm", width=head_dim)
    x = torch.randn(8, head_dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    got = norm_reference(x, own["kind"], own["weight"], own["bias"], eps=own["eps"])
    want = x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + attn.q_norm.eps)
    assert torch.allclose(got, want, rtol=1e-12, atol=0)


def test_the_query_factor_is_dorys_own_and_a_computing_model_that_scales_otherwise_fails():
    """The factor derived for ``sqk`` is Dory's formula on the layer's own ``sqk``; a computing model whose query is
    scaled otherwise (its ``sqk_scale`` changed, its weights the same) must fail."""
    model = _dory("qk_norm_cap")
    attn = _attns(model)[0]
    x = torch.zeros(1, 4, model.config.hidden_size)
    cos, sin = model.model.rotary_emb(x, torch.arange(4)[None], layer_type=model.config.layer_types[0])
    factor = derive.query_factor(attn, model.config, 0, family_of_model(model), "sqk", cos, sin, "half")
    want = (attn.sqk.double() * attn.sqk_scale).square().view(-1, attn.head_dim)
    assert factor is not None and torch.allclose(factor, want, rtol=1e-9)

    assert _judge(model, model).ok
    bad = copy.deepcopy(model)
    for a in _attns(bad):
        a.sqk_scale *= 1.1
    report = _judge(model, bad)
    assert not report.ok, str(report)


def test_a_wrong_second_loop_is_caught_on_its_own_rows():
    """Every second call of the recurrent layer (its second loop) perturbed: the rows of that loop fail, the first
    loop's pass."""
    model = _dory("qk_norm_cap")
    bad = copy.deepcopy(model)
    recurrent = model.config.n_input_layers
    calls = []

    def perturb(module, args, output):
        calls.append(1)
        return (output[0] + 0.05, *output[1:]) if len(calls) % 2 == 0 else output

    _attns(bad)[recurrent].register_forward_hook(perturb)
    report = _judge(model, bad)
    assert not report.ok
    failed = {c.probe for c in report.checks if c.layer == recurrent and not c.ok}
    passed = {c.probe for c in report.checks if c.layer == recurrent and c.ok}
    assert {"unpadded loop 1", "padded loop 1"} <= failed, str(report)
    assert {"unpadded", "padded"} <= passed, str(report)


def test_loops_that_share_one_cache_slot_are_caught():
    """Each loop keeps its cache apart (``cache_offset``); a computing model whose loops all write and read the first
    loop's copy computes cached generation wrongly, which the cached probes and logits must show."""
    model = _dory("qk_norm_cap")
    bad = copy.deepcopy(model)
    for attn in _attns(bad):
        forward = attn.forward
        attn.forward = lambda *args, _f=forward, **kwargs: _f(*args, **{**kwargs, "cache_offset": 0})
    report = _judge(model, bad)
    assert not report.ok, str(report)
    assert any(c.probe.startswith("cache") or c.probe.startswith("logits") for c in report.checks if not c.ok)


def test_loops_sharing_the_last_loops_cache_are_named():
    """``recurrent_kv_cache_mode="last_loop"``: the earlier loops attend over the last loop's cached keys
    (``shared_kv_states``), which the reference does not model: verify fails naming the argument (its cached
    generation also differs from its uncached forward by design)."""
    model = _dory("qk_norm_cap", recurrent_kv_cache_mode="last_loop")
    report = hf_qknorm.verify(model)
    assert not report.ok
    assert any("was given shared_kv_states" in p for p in report.problems()), report.problems()
    assert hf_qknorm.verify(model, generate=False).ok  # without a cache the argument is never given


def test_an_integer_argument_that_changes_what_attention_sees_is_refused():
    """``cache_offset`` is modelled only because it changes nothing the attention function is given, with or without
    a cache; a class that also scales its input by it is refused in one line before any probe runs."""
    model = _dory("qk_norm_cap")
    base = derive.own_class(_attns(model)[0])

    class Offsetting(base):
        def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, cache_offset=0, **kwargs):
            return super().forward(
                hidden_states * (1 + cache_offset), position_embeddings, attention_mask, cache, cache_offset, **kwargs
            )

    Offsetting.__module__ = base.__module__
    assert derive.cache_slot_arguments(_attns(model)[0], model.config, 0, ["cache_offset"]) == ["cache_offset"]
    plain = _attns(model)[0]
    offsetting = plain.__class__.__new__(Offsetting)
    assert derive.cache_slot_arguments(offsetting, model.config, 0, ["cache_offset"]) == []
    for attn in _attns(model):
        attn.__class__ = Offsetting
    with pytest.raises(UnsupportedModelError, match="does not model the cache_offset argument of Offsetting") as err:
        hf_qknorm.verify(model)
    assert "\n" not in str(err.value)


def test_a_peft_wrapped_dory_verifies_with_the_positions_generate_gave_it():
    """Dory's forward counts positions from 0 where it is given none, so the uncached forward must get the positions
    generate gave the model. Under ``peft`` generate calls the model inside the wrapper, not the wrapper's forward:
    the positions are read there (a left-padded row's cached logits otherwise differed from the uncached ones by
    0.02-0.09, the unpatched model's too)."""
    peft = pytest.importorskip("peft")
    for scheme in (None, "qk_norm_cap"):
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        wrapped = peft.get_peft_model(_dory(scheme), config)
        report = hf_qknorm.verify(wrapped)
        assert report.ok, str(report)

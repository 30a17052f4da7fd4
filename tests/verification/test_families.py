"""``verify``'s float64 reference on every kind of attention the structure describes: Gemma's ``1 + w`` q/k norms,
sliding windows, ``query_pre_attn_scalar``, Gemma 2's own cap, Granite's multiplier, partial rotary (Phi, GPT-NeoX,
StableLM, Persimmon), interleaved rotary (Cohere, GLM), gpt-oss's sinks and its per-pair rotary, NoPE layers (SmolLM3,
Cohere 2), per-head fused q/k/v (GPT-NeoX), OLMo 2's whole-projection norms.

Each correct tiny model verifies, unpatched and patched. The adversaries pair a reference model with a computing
model that differs in one thing the weights and config do not show -- a norm gain, the cap, the rotation, the
window -- as a folder loaded without the plugin differs from the one the reference reads; each must FAIL, so the
reference cannot be the computing model's own arithmetic. What the reference does not model is refused in one line.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import hf_qknorm
from hf_qknorm.portable.families import UnsupportedModelError, family_of_model
from hf_qknorm.portable.layout import find_layers
from hf_qknorm.reference import rope_layout_reference
from hf_qknorm.verification import checks, derive, layers, probe
from hf_qknorm.verification.loading import quiet_transformers
from hf_qknorm.verification.tiny import tiny_model

KINDS = [
    "gemma3_text",  # 1 + w q/k norms, sliding layers, query_pre_attn_scalar
    "gemma2",  # its own cap 50, query_pre_attn_scalar
    "granite",  # attention_multiplier
    "phi",  # partial rotary, dense out projection
    "gpt_neox",  # fused query_key_value, per head [q k v], partial rotary
    "stablelm",
    "persimmon",  # fused per head, per-head LayerNorm q/k with biases
    "cohere",  # interleaved rotary
    "glm",  # interleaved rotary from a half-layout cos, partial
    "cohere2",  # NoPE full-attention layers, sliding layers
    "smollm3",  # NoPE layers (no_rope_layers)
    "gpt_oss",  # sinks, rotary with one angle per pair, sliding layers
    "olmo2",  # q/k norms over the whole projection, kept under the scheme's per-head norms
    "afmoe",  # an output gate (sigmoid of a projection of the input, per channel), the model's own code
    "bitnet",  # a norm between the attention and the output projection, the model's own code
    "beam",  # NoPE layers' queries scaled by position (its attention_scaling argument), an output gate
]


def _skip_unless_buildable(model_type):
    """Skip where this Transformers release lacks the type or cannot build its own default config (5.4's Olmo 2 and
    Cohere 2 configs fail huggingface_hub's strict validation: ``tie_word_embeddings`` typed int, given False)."""
    from transformers import AutoConfig

    try:
        AutoConfig.for_model(model_type)
    except Exception as exc:  # noqa: BLE001 - any failure of the release's own config
        pytest.skip(f"transformers {transformers.__version__} cannot build {model_type!r}: {type(exc).__name__}")


def _model(model_type, scheme=None, seed=0):
    """A tiny model of ``model_type`` (patched with ``scheme``/rmsnorm), its 1-d weights moved off their init so
    that the reference must read them (Gemma's ``1 + w`` gains included)."""
    _skip_unless_buildable(model_type)
    with quiet_transformers():
        model = tiny_model(model_type, seed=seed)
    if scheme is not None:
        hf_qknorm.patch_model(model, hf_qknorm.QKNormConfig(scheme, norm="rmsnorm"))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if prm.dim() <= 1 and ("norm" in name or "sinks" in name):
                prm.add_(0.3 * torch.randn(prm.shape, generator=gen))
    return model


def _judge(reference_model, computing_model):
    """The report of ``computing_model``'s probes against the reference read from ``reference_model``."""
    ref = layers.ReferenceModel(reference_model)
    return checks.build_report(ref, probe.run_probes(computing_model, ref.plan(generate=False)))


def _attns(model):
    family = family_of_model(model)
    return family, [getattr(b, family.attention) for b in find_layers(model, family)]


@pytest.mark.parametrize("scheme", [None, "qk_norm_cap"])
@pytest.mark.parametrize("model_type", KINDS)
def test_every_kind_of_attention_verifies(model_type, scheme):
    model = _model(model_type, scheme)
    if scheme is None and model_type == "gemma2" and not _own_cap_changes_logits(model):
        # Releases whose sdpa path drops Gemma 2's own cap (5.4): the verifier must say so, not pass.
        report = hf_qknorm.verify(model, generate=False)
        assert not report.ok and report.mechanism("cap") != "applied", str(report)
        return
    report = hf_qknorm.verify(model, generate=False)
    assert report.ok, str(report)
    assert report.mechanism("causal") == "applied" and report.mechanism("padding") == "applied"
    if scheme is not None or model_type == "gemma2":
        assert report.mechanism("cap") == "applied", str(report)
    if model_type in ("gemma3_text", "cohere2", "gpt_oss"):
        assert report.mechanism("window") == "applied", str(report)


def _own_cap_changes_logits(model):
    """Whether the model's forward applies its own ``attn_logit_softcapping``: logits with the cap as configured
    against the cap made too large to bite, on the same input."""
    ids = torch.arange(1, 9)[None] % model.config.vocab_size
    _, attns = _attns(model)
    with torch.no_grad():
        capped = model(ids).logits
        saved = [a.attn_logit_softcapping for a in attns]
        try:
            for a in attns:
                a.attn_logit_softcapping = 1e9
            uncapped = model(ids).logits
        finally:
            for a, c in zip(attns, saved):
                a.attn_logit_softcapping = c
    return not torch.equal(capped, uncapped)


def test_the_reference_reads_gemmas_gain_as_one_plus_w():
    model = _model("gemma3_text")
    _, attns = _attns(model)
    spec = layers.ReferenceModel(model).spec(0)
    assert torch.allclose(spec.q_norm["weight"], 1 + attns[0].q_norm.weight.detach().double(), atol=1e-6)
    assert spec.scaling == model.config.query_pre_attn_scalar**-0.5


def _skip_unless_given_its_rotation(model_type):
    """Skip where this release's attention computes its rotation itself (GPT-J's before 5.2x, which patching
    refuses): refused, below."""
    _, attns = _attns(_model(model_type))
    if derive.rotates_itself(attns[0]):
        pytest.skip(f"transformers {transformers.__version__}'s {type(attns[0]).__name__} rotates q and k itself")


@pytest.mark.parametrize(
    "model_type,layout,swapped",
    [
        ("llama", "half", False),
        ("cohere", "interleaved", False),
        ("glm", "interleaved_from_half", False),
        ("gpt_oss", "half_per_pair", False),
        ("gptj", "interleaved_per_pair", True),  # (sin, cos), one angle per pair, its function takes one tensor
    ],
)
def test_rotary_layout_is_read_from_the_modelling_file(model_type, layout, swapped):
    _skip_unless_given_its_rotation(model_type)
    model = _model(model_type)
    _, attns = _attns(model)
    x = torch.randn(1, 6, model.config.hidden_size)
    pair = model.base_model.rotary_emb(x, torch.arange(6)[None])  # as the model passes it to its layers
    head_dim = layers.ReferenceModel(model).head_counts(attns[0])[2]
    assert derive.rope_layout(attns[0], model_type, *pair, head_dim) == (layout, swapped)


@pytest.mark.parametrize("scheme", [None, "qk_norm_cap"])
def test_gptj_verifies_with_its_rotation_given_as_sin_and_cos(scheme):
    """GPT-J's layers take ``(sin, cos)``, one angle per interleaved pair, over the first ``rotary_dim`` channels."""
    _skip_unless_given_its_rotation("gptj")
    model = _model("gptj", scheme)
    assert model.config.rotary_dim < model.config.n_embd // model.config.n_head  # partial rotary
    report = hf_qknorm.verify(model, generate=False)
    assert report.ok, str(report)
    assert report.mechanism("causal") == "applied" and report.mechanism("padding") == "applied"
    ref = layers.ReferenceModel(model)
    assert checks.build_report(ref, probe.run_probes(model, ref.plan(generate=False))).ok
    spec = ref.spec(0)  # as the probes settled it
    assert (spec.rotates, spec.rope_layout, spec.rope_swapped) == (True, "interleaved_per_pair", True)


def test_nope_layers_are_read_from_the_attention_class():
    model = _model("smollm3")
    ref = layers.ReferenceModel(model)
    report = checks.build_report(ref, probe.run_probes(model, ref.plan(generate=False)))
    assert report.ok
    rotates = [ref.spec(i).rotates for i in range(len(ref))]
    assert rotates == [bool(v) for v in model.config.no_rope_layers[: len(ref)]]


def test_rope_layouts_agree_on_their_common_case():
    """Partial rotary passes the other channels; the interleaved layouts differ from the half-split one."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 5, 8, generator=gen, dtype=torch.float64)
    angles = torch.rand(1, 5, 2, generator=gen, dtype=torch.float64)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = rope_layout_reference(x, cos, sin, "half")
    assert torch.equal(half[..., 4:], x[..., 4:])
    assert torch.allclose(half, rope_layout_reference(x, cos[..., :2], sin[..., :2], "half_per_pair"))
    assert not torch.allclose(half, rope_layout_reference(x, cos, sin, "interleaved_from_half"))
    pairs = angles.repeat_interleave(2, -1)  # one angle per interleaved pair, as "interleaved" is given it
    interleaved = rope_layout_reference(x, pairs.cos(), pairs.sin(), "interleaved")
    assert torch.equal(interleaved[..., 4:], x[..., 4:]) and not torch.allclose(interleaved, half)
    assert torch.allclose(interleaved, rope_layout_reference(x, angles.cos(), angles.sin(), "interleaved_per_pair"))
    with pytest.raises(ValueError, match="unknown rotary layout 'spiral'; choose one of half"):
        rope_layout_reference(x, cos, sin, "spiral")


# --------------------------------------------------------------------------------------------------------------------
# adversaries: the computing model differs from the reference model in one thing
# --------------------------------------------------------------------------------------------------------------------
ADVERSARY_TYPES = ["gemma3_text", "gpt_neox", "cohere", "gpt_oss", "olmo2", "phi"]


@pytest.mark.parametrize("model_type", ADVERSARY_TYPES)
def test_a_perturbed_norm_gain_fails(model_type):
    model = _model(model_type, "qk_norm_cap")
    assert _judge(model, copy.deepcopy(model)).ok  # the pair agrees while nothing differs
    bad = copy.deepcopy(model)
    family, attns = _attns(bad)
    with torch.no_grad():
        getattr(attns[0], family.norm_slot("q")).weight[0] += 0.5
    report = _judge(model, bad)
    assert not report.ok and "layer 0" in str(report), str(report)


@pytest.mark.parametrize("model_type", [*ADVERSARY_TYPES, "gemma2"])
def test_a_wrong_cap_fails(model_type):
    model = _model(model_type, None if model_type == "gemma2" else "qk_norm_cap")
    bad = copy.deepcopy(model)
    for attn in _attns(bad)[1]:
        if model_type == "gemma2":
            attn.attn_logit_softcapping = 5.0  # the model's own cap, as its forward reads it
        else:
            attn.__dict__["_qknorm_softcap"] /= 4  # the cap the "qknorm" backend applies
    report = _judge(model, bad)
    assert not report.ok and report.mechanism("cap") != "applied", str(report)


@pytest.mark.parametrize(
    "model_type", ["gemma3_text", "gpt_neox", "cohere", "glm", "gpt_oss", "phi", "smollm3", "gptj"]
)
def test_a_missing_rotation_fails(model_type):
    _skip_unless_given_its_rotation(model_type)
    model = _model(model_type, "qk_norm_cap")
    bad = copy.deepcopy(model)
    for attn in _attns(bad)[1]:  # the forward drops the rotation it is given; the recorder sees the one given
        forward = attn.forward

        def unrotated(*args, _forward=forward, **kwargs):
            first, second = kwargs["position_embeddings"]
            identity = (torch.zeros_like(first), torch.ones_like(second))  # GPT-J's order: (sin, cos)
            kwargs["position_embeddings"] = identity if model_type == "gptj" else identity[::-1]
            return _forward(*args, **kwargs)

        attn.forward = unrotated
    report = _judge(model, bad)
    assert not report.ok, str(report)


@pytest.mark.parametrize("model_type", ["gemma3_text", "cohere2", "gpt_oss"])
def test_a_wrong_window_fails(model_type):
    model = _model(model_type, "qk_norm_cap")
    bad = copy.deepcopy(model)
    bad.config.sliding_window = 2 * model.config.sliding_window
    for attn in _attns(bad)[1]:
        if getattr(attn, "sliding_window", None):
            attn.sliding_window = bad.config.sliding_window
    report = _judge(model, bad)
    assert not report.ok and report.mechanism("window") != "applied", str(report)


@pytest.mark.parametrize("model_type, part", [("afmoe", "gate_proj"), ("bitnet", "attn_sub_norm")])
def test_the_output_stage_reads_the_reference_models_weights(model_type, part):
    """Past the attention function the reference runs the model's own code (an output gate, a norm before the
    output projection) on its float64 copy of the reference model's layer: a computing model whose gate or norm
    differs must fail, so the stage is not the computing model's own arithmetic."""
    model = _model(model_type, "qk_norm_cap")
    bad = copy.deepcopy(model)
    with torch.no_grad():
        for attn in _attns(bad)[1]:
            for prm in getattr(attn, part).parameters():
                prm.add_(0.5)
    assert _judge(model, model).ok
    report = _judge(model, bad)
    assert not report.ok, str(report)


# --------------------------------------------------------------------------------------------------------------------
# refused in one line
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "model_type, what",
    [
        ("gptj", "cannot read the rotation GPTJAttention computes itself"),  # releases before 5.2x
    ],
)
def test_what_the_reference_does_not_model_is_refused_in_one_line(model_type, what):
    _skip_unless_buildable(model_type)
    with quiet_transformers():
        model = tiny_model(model_type)
    if model_type == "gptj" and not derive.rotates_itself(_attns(model)[1][0]):
        pytest.skip(f"transformers {transformers.__version__}'s GPT-J is given its rotation: verified, above")
    with pytest.raises(UnsupportedModelError) as err:
        hf_qknorm.verify(model, generate=False)
    line = str(err.value)
    assert "\n" not in line and f"model type {model_type!r}" in line and what in line


def test_a_dropped_query_scale_fails():
    """Beam scales its NoPE layers' queries by ``(1 + position / 2048) ** 0.1`` (its ``attention_scaling``
    argument), which the reference reads as recorded: a computing model that is given the argument and ignores it
    must fail (a factor of 1.0005-1.004 at the probes' positions)."""
    model = _model("beam", "qk_norm_cap")
    bad = copy.deepcopy(model)
    dropped = 0
    for attn in _attns(bad)[1]:
        forward = attn.forward

        def unscaled(*args, _forward=forward, **kwargs):
            kwargs["attention_scaling"] = None
            return _forward(*args, **kwargs)

        attn.forward = unscaled
        dropped += attn.config.layer_types[attn.layer_idx] != "sliding_attention"
    assert dropped, "the tiny Beam has no NoPE layer"
    assert _judge(model, model).ok
    report = _judge(model, bad)
    assert not report.ok, str(report)


def _beam_attention(act):
    """A Beam attention class whose forward hands ``act(attention_scaling, hidden_states)`` on (kwargs updated)."""
    base = type(_attns(_model("beam"))[1][0])

    class Acting(base):
        def forward(self, hidden_states, position_embeddings, attention_mask, attention_scaling=None, **kwargs):
            if attention_scaling is not None:
                hidden_states, attention_scaling = act(hidden_states, attention_scaling)
            return super().forward(hidden_states, position_embeddings, attention_mask, attention_scaling, **kwargs)

    Acting.__module__ = base.__module__  # its modelling file's rotary function is read from there
    return Acting


@pytest.mark.parametrize(
    "act, scales",
    [
        (lambda x, s: (x, s), True),  # Beam's own: the query times the argument
        (lambda x, s: (x, s * s), False),  # the query times its square
        (lambda x, s: (x * s.view(1, -1, 1), s), False),  # the input scaled too: keys and values move
        (lambda x, s: (x, None), False),  # not used at all
    ],
)
def test_only_an_argument_that_scales_the_query_by_position_is_modelled(act, scales):
    """``derive.query_scales`` runs a fresh instance of the attention class with the argument and without: only a
    factor on the query the attention function receives, keys and values unchanged, is modelled; any other use of
    an argument is refused in one line before a probe runs."""
    model = _model("beam")
    _, attns = _attns(model)
    cls = _beam_attention(act)
    assert derive.query_scales(attns[0].__class__.__new__(cls), model.config, 0, ["attention_scaling"]) == (
        ["attention_scaling"] if scales else []
    )
    for attn in attns:
        attn.__class__ = cls
    if scales:
        assert hf_qknorm.verify(model, generate=False).ok
    else:
        with pytest.raises(UnsupportedModelError, match="does not model the attention_scaling argument of Acting"):
            hf_qknorm.verify(model, generate=False)


@pytest.mark.parametrize(
    "model_type, part, placed",
    [
        ("afmoe", "gate_proj", True),
        ("afmoe", "q_proj", False),
        ("afmoe", "rotary_emb", False),  # a module without parameters that the stage never calls
        ("dory", "attn_sub_norm", True),  # a norm without parameters before the output projection
        ("dory", "sqk", False),  # a factor on the rotated query: derive.query_factor models it
    ],
)
def test_a_part_the_reference_does_not_model_must_act_on_the_attention_output(model_type, part, placed):
    """The output stage is the model's own code after the attention function; a part whose parameters do not move
    its output for a fixed attention output (one acting on q or k) cannot be placed there, nor one without
    parameters whose output, scaled, does not reach it."""
    model = _model(model_type)
    family, attns = _attns(model)
    stage = derive.output_stage(attns[0], family)
    if not hasattr(stage, part):
        stage.rotary_emb = torch.nn.Identity()  # a part without parameters
    x = torch.zeros(1, 4, model.config.hidden_size)
    layer_type = {"layer_type": model.config.layer_types[0]} if model_type == "dory" else {}
    cos, sin = model.model.rotary_emb(x, torch.arange(4)[None], **layer_type)  # the rotation a forward records
    assert derive.unplaced_parts(stage, family, [part], cos, sin) == ([] if placed else [part])


@pytest.mark.spawns
def test_folders_of_other_families_verify_without_the_plugin(tmp_path):
    """A saved capped Gemma 3 and gpt-oss, loaded through their remote code in a process without hf_qknorm, against
    the reference read from the same folder loaded with it."""
    from hf_qknorm.verification import verify_folders

    for name in ("gemma3_text", "gpt_oss"):
        _model(name, "qk_norm_cap").save_pretrained(tmp_path / name)
    results = verify_folders([tmp_path / "gemma3_text", tmp_path / "gpt_oss"], no_plugin=True, generate=False)
    for result in results:
        assert result.error is None, result.error
        assert result.report.ok and "trust_remote_code=True" in result.report.source, str(result.report)
        assert result.report.mechanism("cap") == "applied" and result.report.mechanism("window") == "applied"


def test_verify_leaves_the_global_random_state_as_it_was():
    """The rotation check builds fresh layers from a seed of its own; the caller's random numbers do not change."""
    model = _model("smollm3", "qk_norm_cap")  # NoPE layers: every layer's rotation is checked on a fresh instance
    torch.manual_seed(1234)
    want = torch.rand(3)
    torch.manual_seed(1234)
    assert hf_qknorm.verify(model, generate=False).ok
    torch.testing.assert_close(torch.rand(3), want, rtol=0, atol=0)

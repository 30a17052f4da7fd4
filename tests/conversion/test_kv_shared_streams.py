"""The streamed conversion of a model whose last layers attend over keys an earlier layer stored (Gemma 3n, Gemma
4's KV-shared tail): every stream moved through the blocks side by side -- the original, the converted model with
each version of its norms, the inputs a layer is fitted on -- keeps its own store of keys and values, and a layer
reading keys is fitted on those its store layer's kept weights make.

What the streamed figures are checked against is computed here by Transformers' own forward of whole models: the
source, and the source patched and given the conversion's values (perplexities), and each layer's attention output
fed the original's block inputs (the heal's per-layer errors). Sharing one store between the streams makes the
original stream read the converted model's keys; leaving a rejected fit's keys in the fits' store makes the next
reading layer fit, and report, on keys the written model does not have."""

from __future__ import annotations

import pytest
import torch

import hf_qknorm
from hf_qknorm.conversion.calibration.calibrate import CalibrationSettings, new_norm_parameters
from hf_qknorm.conversion.calibration.layerwise import calibrate_checkpoint
from hf_qknorm.conversion.calibration.streaming import BlockCall, PerStream, StreamedCheckpoint
from hf_qknorm.conversion.healing.heal import HealSettings, heal_checkpoint
from hf_qknorm.conversion.orchestration.source import inspect_source
from hf_qknorm.data import perplexity
from hf_qknorm.portable.schemes import QKNormConfig
from tests.conversion.test_kv_shared_convert import _kv_shared_source, inspect_source_reusing

SETTINGS = CalibrationSettings(block_len=16, calibration_blocks=4, eval_blocks=4, local_steps=20, batch_size=2)
CASES = [("gemma4", "qk_norm_cap", "rmsnorm"), ("gemma4", "qk_norm", "l2"), ("gemma3n_text", "qk_norm", "layernorm")]


def _known(kind):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = "gemma4_text" if kind == "gemma4" else kind
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"{model_type} is not in this Transformers")


def _setup(tmp_path, kind, scheme, norm):
    from transformers import AutoModelForCausalLM

    _known(kind)
    src = _kv_shared_source(tmp_path, kind)
    if not inspect_source_reusing(src):
        pytest.skip("this Transformers shares keys and values only through its cache (refused)")
    source = inspect_source(src)
    assert source.reusing
    cfg = QKNormConfig(
        scheme, norm=norm, softcap=5.0 if scheme.endswith("cap") else None, eps=source.family.norm_eps(source.config)
    )
    gen = torch.Generator().manual_seed(0)
    calib = torch.randint(3, 250, (SETTINGS.calibration_blocks, SETTINGS.block_len), generator=gen)
    held = torch.randint(3, 250, (SETTINGS.eval_blocks, SETTINGS.block_len), generator=gen)

    def stream():
        return StreamedCheckpoint(source.config, source.family, source.weights, cfg, torch.device("cpu"))

    def model(values=None):
        m = AutoModelForCausalLM.from_pretrained(src).eval()
        if values is not None:
            hf_qknorm.patch_model(m, cfg)
            state = m.state_dict()
            with torch.no_grad():
                for name, value in values.items():
                    state[name].copy_(value)
        return m

    return source, cfg, stream, model, calib, held


@pytest.mark.parametrize("kind, scheme, norm", CASES)
def test_the_streamed_calibration_report_is_the_models_own_forward(tmp_path, kind, scheme, norm):
    source, cfg, stream, model, calib, held = _setup(tmp_path, kind, scheme, norm)
    s = stream()
    values, report = calibrate_checkpoint(s, cfg, calib, held, SETTINGS, progress=False)
    original = model()
    assert report.ppl_original == pytest.approx(perplexity(original, held, batch_size=2), rel=1e-5)
    patched = model(values)
    assert set(new_norm_parameters(patched)) == set(values)
    assert report.ppl_calibrated == pytest.approx(perplexity(patched, held, batch_size=2), rel=1e-5)
    assert report.ppl_calibrated != report.ppl_original
    assert all(layer.fit_error <= layer.fit_error_closed_form for layer in report.layers)


def _attention_errors(original, converted, ids) -> list[float]:
    """Per layer, the relative squared error of ``converted``'s attention output against ``original``'s, each of
    ``converted``'s blocks fed the hidden states ``original``'s block received (what the heal fits: a reusing
    layer then attends over the keys ``converted``'s store layer makes from the original's inputs)."""
    inputs, targets, outputs = {}, {}, {}
    hooks = []
    for i, layer in enumerate(original.model.layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0].clone())))
        hooks.append(layer.self_attn.register_forward_hook(lambda m, a, o, i=i: targets.__setitem__(i, o[0])))
    with torch.no_grad():
        original(ids)
    for hook in hooks:
        hook.remove()
    hooks = []
    for i, layer in enumerate(converted.model.layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: (inputs[i], *a[1:])))
        hooks.append(layer.self_attn.register_forward_hook(lambda m, a, o, i=i: outputs.__setitem__(i, o[0])))
    with torch.no_grad():
        converted(ids)
    for hook in hooks:
        hook.remove()
    return [
        float((outputs[i] - targets[i]).double().pow(2).mean() / targets[i].double().pow(2).mean())
        for i in sorted(targets)
    ]


@pytest.mark.parametrize("lr", [1e-3, 30.0], ids=["fits", "fits-rejected"])
@pytest.mark.parametrize("kind, scheme, norm", CASES[::2])
def test_the_heal_reports_the_errors_and_perplexities_of_the_weights_it_keeps(tmp_path, kind, scheme, norm, lr):
    """Each layer's error after healing, and the healed perplexity, are those of the written weights computed by
    the whole model's forward; with a step size that makes fits diverge (so they are rejected and the layers keep
    their calibrated weights) the reusing layers are still fitted and judged on the kept keys."""
    source, cfg, stream, model, calib, held = _setup(tmp_path, kind, scheme, norm)
    values, report = calibrate_checkpoint(stream(), cfg, calib, held, SETTINGS, progress=False)
    settings = HealSettings(tokens=16 * 24, blocks=4, lr=lr, lr_search=False, text="calibration").for_scheme(scheme)
    healed, heal = heal_checkpoint(stream(), values, calib, held, settings, batch_size=2, progress=False)
    if lr > 1:
        assert heal.layers_kept < len(source.reusing) + 2, "the diverging step size should have lost some fits"
    original, converted = model(), model(healed)
    assert heal.ppl_original == pytest.approx(perplexity(original, held, batch_size=2), rel=1e-5)
    assert heal.ppl_before == pytest.approx(perplexity(model(values), held, batch_size=2), rel=1e-5)
    assert heal.ppl_after == pytest.approx(perplexity(converted, held, batch_size=2), rel=1e-5)
    after = [a for _, a in heal.layer_errors]
    assert after == pytest.approx(_attention_errors(original, converted, calib), rel=1e-4)


def test_a_call_holding_a_shared_store_runs_only_in_a_named_stream():
    """A block call whose forward's blocks share a mapping is never run on a mapping another stream wrote: without
    a stream it is refused; each stream gets its own copy, the same for every block of that forward."""
    store = {}
    per = PerStream(store)
    first = BlockCall((), {"shared_kv_states": per, "x": 1}, False)
    second = BlockCall((), {"shared_kv_states": per}, False)
    with pytest.raises(RuntimeError, match="without naming its stream"):
        first.bind(None)
    a1, a2 = first.bind("a").kwargs["shared_kv_states"], second.bind("a").kwargs["shared_kv_states"]
    b1 = first.bind("b").kwargs["shared_kv_states"]
    assert a1 is a2 and a1 is not b1 and first.bind("a").kwargs["x"] == 1
    t = torch.ones(2, requires_grad=True) * 2
    a1["full_attention"] = (t, t)
    assert "full_attention" not in b1 and not a2["full_attention"][0].requires_grad
    plain = BlockCall((1,), {"y": 2}, True)
    assert plain.bind(None) is plain


@pytest.mark.parametrize("kind, scheme, norm", CASES[1:])
def test_distillation_reads_the_originals_keys_and_leaves_the_fits_stream_alone(
    tmp_path, monkeypatch, kind, scheme, norm
):
    """With the attention-probability term, each layer's teacher -- a layer reading keys an earlier layer stored
    included -- gives the original model's own eager attention probabilities on the heal blocks (read through the
    fits' store, a reading layer's teacher would attend over the converted model's keys), and the reported errors
    are still those of the written weights (the teacher writes nothing into the fits' store)."""
    from hf_qknorm.conversion.healing import heal as heal_module

    source, cfg, stream, model, calib, held = _setup(tmp_path, kind, scheme, norm)
    values, _ = calibrate_checkpoint(stream(), cfg, calib, held, SETTINGS, progress=False)
    seen, fit = [], heal_module._fit

    def recording(attn, calls, targets, settings, block_len, seed, tick, teacher=None):
        seen.append(torch.cat([teacher(j) for j in range(len(calls))]))
        return fit(attn, calls, targets, settings, block_len, seed, tick, teacher)

    monkeypatch.setattr(heal_module, "_fit", recording)
    settings = HealSettings(tokens=16 * 24, blocks=4, lr_search=False, text="calibration", attention_kl=1.0)
    healed, heal = heal_checkpoint(stream(), values, calib, held, settings, batch_size=2, progress=False)
    original = model()
    original.set_attn_implementation("eager")
    with torch.no_grad():
        eager = original(calib, output_attentions=True).attentions
    assert len(seen) == len(eager) == original.config.num_hidden_layers
    for i, (teacher, own) in enumerate(zip(seen, eager)):
        torch.testing.assert_close(teacher, own, rtol=1e-4, atol=2e-5, msg=lambda m, i=i: f"layer {i}: {m}")
    original.set_attn_implementation("sdpa")
    after = [a for _, a in heal.layer_errors]
    assert after == pytest.approx(_attention_errors(original, model(healed), calib), rel=1e-4)

"""Attention-probability distillation in the heal's layer fits (``HealSettings.attention_kl``,
``--heal-attention-kl``).

What is checked against something the healing code did not compute: the KL term against the divergence written out
in float64; the attention probabilities a fit reads (a recorded call asked for its weights on the ``"qknorm"``
backend) against Transformers' own eager attention of the unpatched model -- sliding windows the keys exceed, a
model's own cap (Gemma 2), attention sinks (gpt-oss), ``1 + w`` q/k norms (Gemma 3), GPT-2's attention -- and, for a
patched layer, the output that call returns against the layer's ordinary output; the written model's attention
(eager, loaded by plain Transformers) against the original's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import hf_qknorm
from hf_qknorm.conversion.calibration.localfit import attention_kl, attention_output, attention_with_weights
from hf_qknorm.conversion.calibration.streaming import BlockCall
from hf_qknorm.conversion.orchestration.texts import text_blocks
from hf_qknorm.data import split_text
from hf_qknorm.modeling.saved import auto_class
from hf_qknorm.portable.families import family_of_model
from hf_qknorm.portable.layout import find_layers
from hf_qknorm.verification.tiny import tiny_config
from tests._support.convert_support import SHORT_TEXT, bundled_copy
from tests.conversion.test_heal import FAST, HEAL, _convert

WINDOW, LENGTH = 4, 11  # a sliding window the keys exceed


def _kl64(t: torch.Tensor, s: torch.Tensor, sinks: tuple[float, float] | None = None) -> float:
    """The mean KL divergence of the rows, written out in float64; ``sinks``: each row's sink share in ``t`` and in
    ``s``, one more outcome."""
    t, s = t.double(), s.double()
    if sinks is not None:
        t = torch.cat([t, torch.full_like(t[..., :1], sinks[0])], -1)
        s = torch.cat([s, torch.full_like(s[..., :1], sinks[1])], -1)
    terms = torch.where(t > 0, t * (t / s).log(), torch.zeros_like(t))
    return terms.sum(-1).mean().item()


def test_attention_kl_is_the_divergence_of_the_rows():
    gen = torch.Generator().manual_seed(0)
    allowed = torch.rand(2, 3, 6, 7, generator=gen) > 0.3
    allowed[..., 0] = True

    def rows():
        logits = torch.randn(2, 3, 6, 7, generator=gen).masked_fill(~allowed, float("-inf"))
        return logits.softmax(-1)

    t, s = rows(), rows()
    assert attention_kl(t, s).item() == pytest.approx(_kl64(t, s), rel=1e-5)
    assert attention_kl(t, s).item() > 0.05
    assert abs(attention_kl(t, t).item()) < 1e-6
    # attention sinks: each row's remaining mass is the sink's share, one more outcome
    t_sink, s_sink = t * 0.7, s * 0.9
    assert attention_kl(t_sink, s_sink).item() == pytest.approx(_kl64(t_sink, s_sink, (0.3, 0.1)), rel=1e-5)
    assert attention_kl(t_sink, s_sink).item() != pytest.approx(attention_kl(t, s).item(), rel=1e-2)
    # a query with no allowed key (all zeros in both) adds nothing but counts in the mean
    t_empty, s_empty = t.clone(), s.clone()
    t_empty[0, 0, 0], s_empty[0, 0, 0] = 0.0, 0.0
    assert attention_kl(t_empty, s_empty).item() == pytest.approx(_kl64(t_empty, s_empty), rel=1e-5)
    # the gradient reaches the student only
    s_param = s.clone().requires_grad_(True)
    attention_kl(t, s_param).backward()
    assert s_param.grad is not None and torch.isfinite(s_param.grad).all()


def _model(model_type: str) -> torch.nn.Module:
    config = tiny_config(model_type)
    text = config.get_text_config()
    if getattr(text, "sliding_window", None) is not None:
        text.sliding_window = WINDOW
    torch.manual_seed(0)
    return auto_class(config).from_config(config, dtype=torch.float32).eval()


def _recorded(model, ids) -> tuple[torch.nn.Module, list[BlockCall]]:
    """Each layer's attention module and the call it received in one forward, as a fit records it."""
    family = family_of_model(model)
    attns = [getattr(block, family.attention) for block in find_layers(model, family)]
    calls = {}

    def record(i):
        def hook(module, args, kwargs):
            calls.setdefault(i, BlockCall(args, kwargs, True))

        return hook

    hooks = [a.register_forward_pre_hook(record(i), with_kwargs=True) for i, a in enumerate(attns)]
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return attns, [calls[i] for i in range(len(attns))]


@pytest.mark.parametrize("model_type", ["llama", "mistral", "gemma2", "gpt_oss", "gemma3_text", "gpt2"])
def test_the_probabilities_a_fit_reads_are_the_models_own(model_type):
    """Unpatched, on the "qknorm" backend: the weights of each recorded call are Transformers' eager attention's
    (windows, the model's cap, sinks included); patched with a cap, the call that returns them returns the layer's
    ordinary output, and their KL from the original's is what the fit would start from (positive: the cap bites)."""
    model = _model(model_type)
    ids = torch.randint(
        1, model.config.get_text_config().vocab_size, (2, LENGTH), generator=torch.Generator().manual_seed(1)
    )
    model.set_attn_implementation("eager")
    with torch.no_grad():
        eager = model(ids, output_attentions=True).attentions
    model.set_attn_implementation("qknorm")
    attns, calls = _recorded(model, ids)
    teachers = []
    for i, (attn, call) in enumerate(zip(attns, calls)):
        with torch.no_grad():
            out, weights = attention_with_weights(attn, call)
            plain = attention_output(attn, call)
        torch.testing.assert_close(weights, eager[i], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-6)
        teachers.append(weights)

    patched = hf_qknorm.patch_model(model, "qk_norm_cap", softcap=2.0)
    attns, calls = _recorded(patched, ids)
    for attn, call, teacher in zip(attns, calls, teachers):
        with torch.no_grad():
            out, weights = attention_with_weights(attn, call)
            plain = attention_output(attn, call)
        torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-6)
        assert attention_kl(teacher, weights).item() > 1e-4


def test_kl_is_zero_where_the_conversion_changes_nothing():
    """A qk_norm / rmsnorm patch of Qwen3 (its own RMS q/k norms) computes the original attention: the KL term the
    fit starts from is 0, so distillation pulls nothing away from the original."""
    model = _model("qwen3")
    ids = torch.randint(1, model.config.vocab_size, (2, LENGTH), generator=torch.Generator().manual_seed(2))
    model.set_attn_implementation("qknorm")
    attns, calls = _recorded(model, ids)
    with torch.no_grad():
        teachers = [attention_with_weights(a, c)[1] for a, c in zip(attns, calls)]
    patched = hf_qknorm.patch_model(model, "qk_norm", norm="rmsnorm")
    attns, calls = _recorded(patched, ids)
    for attn, call, teacher in zip(attns, calls, teachers):
        with torch.no_grad():
            assert abs(attention_kl(teacher, attention_with_weights(attn, call)[1]).item()) < 1e-7


def _attention_kl_of_folders(src, converted, blocks) -> float:
    """Mean over layers and held-out blocks of the written model's attention KL from the source's (eager, plain
    Transformers)."""
    kls = []
    with torch.no_grad():
        for folder in (src, converted):
            model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
            kls.append([model(b[None], output_attentions=True).attentions for b in blocks])
    original, healed = kls
    return sum(attention_kl(t, s).item() for per_o, per_h in zip(original, healed) for t, s in zip(per_o, per_h)) / sum(
        len(per) for per in original
    )


def test_distillation_brings_the_written_attention_closer_to_the_originals(tmp_path):
    """The bundled tiny Llama healed with and without the term (same seed, steps and text): with it, the written
    model's attention probabilities on held-out text are closer to the original's, and the report records the
    weight."""
    src = bundled_copy(tmp_path / "src")
    without = dataclasses.replace(HEAL, attention_kl=0.0)
    plain = _convert(src, tmp_path / "plain", scheme="qk_norm_cap", norm="rmsnorm", heal=without)
    heal = dataclasses.replace(HEAL, attention_kl=10.0)
    distilled = _convert(src, tmp_path / "kl", scheme="qk_norm_cap", norm="rmsnorm", heal=heal)
    assert distilled.report.heal["settings"]["attention_kl"] == 10.0
    assert plain.report.heal["settings"]["attention_kl"] == 0.0
    assert "attention probabilities distilled (weight 10)" in distilled.report.summary()
    assert "distilled" not in plain.report.summary()
    assert "output error alone (no attention term)" in plain.report.summary()
    held_out = split_text(SHORT_TEXT, 0.1)[1]
    blocks = text_blocks(held_out, AutoTokenizer.from_pretrained(src), 64, FAST.eval_blocks, "held-out")
    kl_plain = _attention_kl_of_folders(src, plain.path, blocks)
    kl_distilled = _attention_kl_of_folders(src, distilled.path, blocks)
    assert kl_distilled < 0.9 * kl_plain, (kl_distilled, kl_plain)


def _written(folder) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("budget", ["none", "one block"])
def test_keeping_the_teachers_probabilities_changes_the_time_not_the_result(tmp_path, monkeypatch, budget):
    """The original layer's probabilities are kept between the draws of a fit (``TEACHER_CACHE_BYTES``): the healed
    model written with every block's kept is the one written with none kept, or only the first, bit for bit, and
    the original layer runs once per block with room for all."""
    from hf_qknorm.conversion.calibration import localfit
    from hf_qknorm.conversion.healing import heal as heal_module

    src = bundled_copy(tmp_path / "src")
    heal = dataclasses.replace(HEAL, attention_kl=1.0)
    asked = []
    real = localfit.attention_with_weights

    def counted(attn, call, overrides=None):
        asked.append(overrides is None and not torch.is_grad_enabled())
        return real(attn, call, overrides)

    monkeypatch.setattr(heal_module, "attention_with_weights", counted)
    kept_all = _convert(src, tmp_path / "all", scheme="qk_norm_cap", norm="rmsnorm", heal=heal)
    teacher_runs = sum(asked)
    config = AutoConfig.from_pretrained(src)
    assert teacher_runs == config.num_hidden_layers * HEAL.blocks, teacher_runs  # once per block and layer
    block_bytes = 0 if budget == "none" else config.num_attention_heads * FAST.block_len**2 * 4
    monkeypatch.setattr(heal_module, "TEACHER_CACHE_BYTES", block_bytes)
    asked.clear()
    kept_less = _convert(src, tmp_path / "less", scheme="qk_norm_cap", norm="rmsnorm", heal=heal)
    assert sum(asked) > teacher_runs
    a, b = _written(kept_all.path), _written(kept_less.path)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k

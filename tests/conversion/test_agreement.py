"""Answer agreement (hf_qknorm.conversion.orchestration.agreement): checked against Transformers' own greedy
``generate`` and a one-position-at-a-time teacher-forced loop, never against the module's own shortcuts."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_qknorm.conversion.orchestration.agreement import (
    Prompt,
    _greedy_batch,
    agreement,
    answer_agreement,
    encode_prompt,
    load_prompts,
    reference_continuations,
)
from hf_qknorm.data import bundled_model_dir
from tests._support.tiny_models import VOCAB, tiny_model

PROMPTS = [
    Prompt("First Citizen:\nBefore we proceed", "text"),
    Prompt("ROMEO:\n", "text"),
    Prompt("What say you, my lord?", "chat", chat=True),
    Prompt("KING", "fact"),
    Prompt("O, she doth teach the torches to burn bright! It seems", "text"),
]
N = 12


@pytest.fixture(scope="module")
def bundled():
    tok = AutoTokenizer.from_pretrained(bundled_model_dir())
    model = AutoModelForCausalLM.from_pretrained(bundled_model_dir(), dtype=torch.float32).eval()
    return model, tok


def _perturbed(model, scale: float):
    """A copy of ``model`` whose layer-1 MLP output has noise added (``scale`` times its weights' RMS)."""
    other = AutoModelForCausalLM.from_pretrained(bundled_model_dir(), dtype=torch.float32).eval()
    w = other.model.layers[1].mlp.down_proj.weight
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        w.add_(scale * w.pow(2).mean().sqrt() * torch.randn(w.shape, generator=gen))
    return other


def _hf_greedy(model, tok, prompt: Prompt) -> list[int]:
    ids = torch.tensor([encode_prompt(tok, prompt)])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=N,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
    )
    return out[0, ids.shape[1] :].tolist()


def _expected(original, converted, tok) -> tuple[float, float]:
    """Prefix agreement from two ``generate`` runs; top-1 from one unpadded forward per reference position."""
    fractions, hits, total = [], 0, 0
    for prompt in PROMPTS:
        ref, got = _hf_greedy(original, tok, prompt), _hf_greedy(converted, tok, prompt)
        k = 0
        while k < len(ref) and k < len(got) and ref[k] == got[k]:
            k += 1
        fractions.append(k / len(ref))
        ids = encode_prompt(tok, prompt)
        for t in range(len(ref)):
            with torch.no_grad():
                logits = converted(torch.tensor([ids + ref[:t]])).logits[0, -1]
            hits += int(int(logits.argmax()) == ref[t])
            total += 1
    return sum(fractions) / len(fractions), hits / total


def test_identical_models_agree_fully(bundled):
    model, tok = bundled
    report = answer_agreement(model, model, tok, PROMPTS, new_tokens=N)
    assert (report.prefix, report.top1, report.whole, report.prompts) == (1.0, 1.0, len(PROMPTS), len(PROMPTS))


def test_reference_is_transformers_greedy_generation(bundled):
    model, tok = bundled
    assert reference_continuations(model, tok, PROMPTS, N) == [_hf_greedy(model, tok, p) for p in PROMPTS]


@pytest.mark.parametrize("scale", [0.3, 2.0])
def test_perturbed_model_matches_independent_computation(bundled, scale):
    model, tok = bundled
    other = _perturbed(model, scale)
    report = answer_agreement(model, other, tok, PROMPTS, new_tokens=N)
    prefix, top1 = _expected(model, other, tok)
    assert report.prefix == pytest.approx(prefix, abs=1e-12) and report.top1 == pytest.approx(top1, abs=1e-12)
    assert report.prefix < 1.0 and report.top1 < 1.0
    assert sum(v["prompts"] for v in report.by_kind.values()) == len(PROMPTS)


def test_early_end_token_shortens_the_reference(bundled):
    """A reference that ends in the end token is compared over its own length."""
    model, tok = bundled
    ref = reference_continuations(model, tok, PROMPTS[:1], N)[0]
    model.generation_config.eos_token_id = ref[2]  # pretend the third token ends the answer
    try:
        short = reference_continuations(model, tok, PROMPTS[:1], N)[0]
    finally:
        model.generation_config.eos_token_id = tok.eos_token_id
    assert short == ref[:3]


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3"])
def test_left_padded_batch_equals_one_prompt_at_a_time(family):
    """Batched greedy decoding (left padding, positions from each prompt's start) is decoding each prompt alone."""
    model = tiny_model(family)
    if family == "gpt2":  # absolute positions: make them decide the argmax, so a wrong position id shows
        with torch.no_grad():
            model.transformer.wpe.weight.mul_(50)
    gen = torch.Generator().manual_seed(0)
    encoded = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 11, 7, 1)]
    together = _greedy_batch(model, encoded, 9, set())
    alone = [_greedy_batch(model, [e], 9, set())[0] for e in encoded]
    assert together == alone and all(len(c) == 9 for c in together)


def test_patched_model_batched_reference():
    import hf_qknorm

    model = hf_qknorm.patch_model(tiny_model("llama"), "qk_norm_cap", norm="layernorm", softcap=5.0)
    encoded = [[5, 6, 7, 8, 9, 10], [3], [40, 41, 42]]
    assert _greedy_batch(model, encoded, 6, set()) == [_greedy_batch(model, [e], 6, set())[0] for e in encoded]


def test_chat_prompts_use_the_chat_template(bundled):
    _, tok = bundled
    chat, plain = Prompt("Hello there", chat=True), Prompt("Hello there")
    assert encode_prompt(tok, chat) == encode_prompt(tok, plain)  # no template: the text as it is
    tok = AutoTokenizer.from_pretrained(bundled_model_dir())
    tok.chat_template = "{% for m in messages %}USER: {{ m['content'] }}\n{% endfor %}ANSWER:"
    ids = encode_prompt(tok, chat)
    assert tok.decode(ids) == "USER: Hello there\nANSWER:"
    assert encode_prompt(tok, plain) != ids


def test_bundled_prompt_set():
    prompts = load_prompts()
    kinds = {p.kind for p in prompts}
    assert len(prompts) >= 40 and {"fact", "arithmetic", "code", "instruction", "chat"} <= kinds
    assert all(p.chat for p in prompts if p.kind == "chat") and len({p.text for p in prompts}) == len(prompts)


def test_bad_prompt_files_are_named(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="p.json is not valid JSON"):
        load_prompts(bad)
    bad.write_text(json.dumps([{"kind": "fact"}]))
    with pytest.raises(ValueError, match="entry 0 has no non-empty 'text'"):
        load_prompts(bad)
    bad.write_text("[]")
    with pytest.raises(ValueError, match="non-empty JSON list"):
        load_prompts(bad)


def test_mismatched_reference_is_an_error(bundled):
    model, tok = bundled
    with pytest.raises(ValueError, match="2 prompts and 1 reference"):
        agreement(model, tok, PROMPTS[:2], [[1]])
    with pytest.raises(ValueError, match="new_tokens must be >= 1"):
        reference_continuations(model, tok, PROMPTS, 0)


@pytest.mark.spawns
def test_conversion_reports_the_written_models_agreement(tmp_path, bundled):
    """convert() measures the folder it writes: its figure is the one computed here from the reloaded folder, and
    the JSON report, the model card and the printed summary carry it."""
    import hf_qknorm
    from hf_qknorm.conversion.calibration.calibrate import CalibrationSettings
    from tests._support.convert_support import SHORT_TEXT, quiet

    settings = CalibrationSettings(block_len=64, calibration_blocks=4, eval_blocks=4, local_steps=5, agreement_tokens=N)
    result = hf_qknorm.convert(
        None, tmp_path / "out", calibration=settings, calibration_text=SHORT_TEXT, progress=False, log=quiet
    )
    original, tok = bundled
    converted = AutoModelForCausalLM.from_pretrained(result.path, dtype=torch.float32).eval()
    expected = answer_agreement(original, converted, tok, new_tokens=N)
    got = result.report.agreement
    assert (got["prefix"], got["top1"], got["whole"], got["new_tokens"]) == (
        expected.prefix,
        expected.top1,
        expected.whole,
        N,
    )
    assert 0.0 < got["top1"] < 1.0
    saved = json.loads((result.path / "qknorm_conversion.json").read_text())["calibration"]["agreement"]
    assert saved == got
    card = (result.path / "README.md").read_text()
    assert f"**{100 * got['prefix']:.1f}%**" in card and f"**{100 * got['top1']:.1f}%**" in card
    assert f"prefix {100 * got['prefix']:.1f}%" in result.report.summary()


@pytest.mark.spawns
def test_agreement_tokens_zero_skips_the_check(tmp_path):
    import hf_qknorm
    from hf_qknorm.conversion.calibration.calibrate import CalibrationSettings
    from tests._support.convert_support import SHORT_TEXT, quiet

    settings = CalibrationSettings(block_len=64, calibration_blocks=4, eval_blocks=4, local_steps=0, agreement_tokens=0)
    result = hf_qknorm.convert(
        None, tmp_path / "out", calibration=settings, calibration_text=SHORT_TEXT, progress=False, log=quiet
    )
    assert result.report.agreement is None and "answer agreement" not in result.report.summary()
    assert "Answers kept" not in (result.path / "README.md").read_text()
    with pytest.raises(ValueError, match="agreement_tokens must be >= 0"):
        CalibrationSettings(agreement_tokens=-1)

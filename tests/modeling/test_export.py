"""Folders that load anywhere: plain ``qwen3`` exports, and ``qknorm_<base>`` folders with remote code.

Every folder a patched model saves carries the remote code (:mod:`hf_qknorm.modeling.remote`: the plugin's own
modules). A subprocess in which ``hf_qknorm`` cannot be imported loads saved and exported folders through plain
Transformers (``trust_remote_code=True``) and must give the plugin's logits, generations and gradients, for every
family and scheme. ``HF_QKNORM_PYTHON`` names another interpreter for that subprocess (CI runs it at both ends of
the supported Transformers range).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import hf_qknorm
from hf_qknorm import get_family
from hf_qknorm.conversion.output.export import qwen3_blocker, resolve_export
from hf_qknorm.modeling.remote import add_remote_code, remote_files
from hf_qknorm.portable.schemes import QKNormConfig
from tests._support.convert_support import quiet, save_source
from tests._support.tiny_models import FAMILY_NAMES, VOCAB, tiny_config, tiny_model

CASES = (
    [(f, "qk_norm_cap", "layernorm") for f in FAMILY_NAMES]
    + [(f, "qkv_norm", "rmsnorm") for f in FAMILY_NAMES]
    + [
        ("llama", "qk_norm", "lp"),
        ("gpt2", "qk_norm_cap", "l2"),
        ("qwen3", "soft_cap", None),
        ("mistral", "soft_cap", None),
    ]
)


def _patched(family, scheme, norm, dtype=torch.float32, seed=0):
    model = tiny_model(family, dtype=dtype, seed=seed)
    hf_qknorm.patch_model(
        model, scheme, norm=norm, p=3.0 if norm == "lp" else None, softcap=0.5 if "cap" in scheme else None
    )  # a cap that really bends the logits
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "_norm." in name:
                prm.add_(0.3 * torch.randn_like(prm))
    return model


# --------------------------------------------------------------------------------------------------------------------
# a process where hf_qknorm cannot be imported
# --------------------------------------------------------------------------------------------------------------------
_LOADER = textwrap.dedent("""
    import json, sys
    sys.modules["hf_qknorm"] = None  # any import of the plugin now fails
    import torch
    import transformers
    jobs = json.load(open(sys.argv[1]))
    out = {}
    for job in jobs:  # "auto": the Auto class to load with (a multimodal model's), AutoModelForCausalLM by default
        auto = getattr(transformers, job.get("auto", "AutoModelForCausalLM"))
        model = auto.from_pretrained(job["path"], trust_remote_code=job["remote"]).eval()
        ids, mask = torch.tensor(job["ids"]), torch.tensor(job["mask"])
        row = {"cls": type(model).__name__, "module": type(model).__module__, "dtype": str(model.dtype),
               "backend": model.config._attn_implementation}
        with torch.no_grad():
            row["logits"] = model(ids, attention_mask=mask).logits
        if job.get("generate"):
            row["generated"] = model.generate(ids[1:], max_new_tokens=8, do_sample=False)
            static = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True, cache_implementation="static", pad_token_id=0)
            row["static_logits"] = torch.stack(static.logits)
            packed = torch.tensor([job["packed_ids"]])
            row["packed"] = model(packed, position_ids=torch.tensor([job["packed_positions"]]),
                                  use_cache=True).logits
        if job.get("grads"):
            model.train()
            model(ids[1:], labels=ids[1:]).loss.backward()
            row["grads"] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        out[job["name"]] = row
    assert not any(name.startswith("hf_qknorm") for name in sys.modules if sys.modules[name] is not None)
    torch.save(out, sys.argv[2])
""")


def _inputs():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, 30), generator=g)  # longer than Mistral's window of 12
    mask = torch.ones_like(ids)
    mask[0, :6] = 0  # left padding
    return ids, mask


def run_without_plugin(tmp_path, jobs: list[dict]) -> dict:
    """Run the loader over ``jobs`` in a fresh interpreter that cannot import hf_qknorm."""
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    script = tmp_path / "load.py"
    script.write_text(_LOADER)
    python = os.environ.get("HF_QKNORM_PYTHON", sys.executable)
    res = subprocess.run(
        [python, str(script), str(tmp_path / "jobs.json"), str(tmp_path / "out.pt")],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return torch.load(tmp_path / "out.pt")


@pytest.mark.spawns
def test_saved_folders_load_without_the_plugin(tmp_path):
    """model.save_pretrained of a patched model, every family and scheme: same logits without the plugin;
    generation and gradients too for a capped Llama."""
    ids, mask = _inputs()
    jobs, models = [], {}
    for family, scheme, norm in CASES:
        name = f"{family}-{scheme}-{norm}"
        model = _patched(family, scheme, norm).eval()
        model.save_pretrained(tmp_path / name)
        models[name] = model
        extra = (
            dict(
                generate=True,
                grads=True,
                packed_ids=ids[1, :16].tolist(),
                packed_positions=list(range(9)) + list(range(7)),
            )
            if name == "llama-qk_norm_cap-layernorm"
            else {}
        )
        jobs.append(
            {
                "name": name,
                "path": str(tmp_path / name),
                "remote": True,
                "ids": ids.tolist(),
                "mask": mask.tolist(),
                **extra,
            }
        )
    got = run_without_plugin(tmp_path, jobs)
    for name, model in models.items():
        row = got[name]
        assert row["module"].startswith("transformers_modules") and row["cls"] == f"QKNorm{type(model).__name__}"
        with torch.no_grad():
            expected = model(ids, attention_mask=mask).logits
        torch.testing.assert_close(row["logits"][1], expected[1], rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(row["logits"][0, 6:], expected[0, 6:], rtol=1e-5, atol=1e-5, msg=name)
        if "generated" in row:
            assert torch.equal(row["generated"], model.generate(ids[1:], max_new_tokens=8, do_sample=False))
            # static cache (prefill without a mask: top-left causal) against the plugin's uncached forward
            with torch.no_grad():
                ref = model(ids, attention_mask=mask).logits[:, -1]
            torch.testing.assert_close(row["static_logits"][0], ref, rtol=1e-5, atol=1e-5)
            # packed sequences with the cache on: each its own
            packed = ids[1, :16]
            for a, b in ((0, 9), (9, 16)):
                with torch.no_grad():
                    alone = model(packed[None, a:b]).logits[0]
                torch.testing.assert_close(row["packed"][0, a:b], alone, rtol=1e-5, atol=1e-5)
            model.train()
            model(ids[1:], labels=ids[1:]).loss.backward()
            for n, prm in model.named_parameters():
                torch.testing.assert_close(row["grads"][n], prm.grad, rtol=1e-4, atol=1e-5, msg=n)


def test_remote_code_imports_only_torch_transformers_and_itself():
    allowed = {
        "__future__",
        "copy",
        "dataclasses",
        "logging",
        "math",
        "sys",
        "threading",
        "typing",
        "torch",
        "transformers",
    }
    files = remote_files()
    for name, text in files.items():
        tree = ast.parse(text)
        roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
        assert roots <= allowed, (name, roots - allowed)
        relative = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level > 0}
        assert {f"{m}.py" for m in relative} <= set(files), (name, relative)


def test_add_remote_code_refuses_unpatched_folders(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not saved from a model patched by hf_qknorm"):
        add_remote_code(tmp_path)


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
    result = hf_qknorm.convert(
        tmp_path / "src",
        tmp_path / "out",
        config=QKNormConfig(scheme="qk_norm", norm="rmsnorm"),
        calibrate=False,
        progress=False,
        log=quiet,
        verify="plugin",
    )
    assert result.export == "qknorm" and "mlp_bias" in result.export_note
    assert json.loads((result.path / "config.json").read_text())["model_type"] == "qknorm_llama"


def _source(tmp_path, name, family, dtype=torch.float32, **overrides):
    return save_source(tmp_path / name, family, dtype=dtype, **overrides)


@pytest.mark.spawns
def test_exports_load_without_the_plugin(tmp_path):
    ids = torch.randint(0, VOCAB, (2, 30))
    cases = {  # name: (family, scheme, norm, expected format, dtype, config overrides)
        "llama_qwen3": (
            "llama",
            "qk_norm",
            "rmsnorm",
            "qwen3",
            torch.float32,
            dict(
                attention_bias=True,
                tie_word_embeddings=True,
                rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
            ),
        ),
        "mistral_qwen3": ("mistral", "qk_norm", "rmsnorm", "qwen3", torch.float32, {}),  # window 12 < 30
        "llama_cap_bf16": ("llama", "qk_norm_cap", "layernorm", "qknorm", torch.bfloat16, {}),
        "gpt2_qkv": ("gpt2", "qkv_norm", "layernorm", "qknorm", torch.float32, {}),
        "qwen2_lp": ("qwen2", "qk_norm", "lp", "qknorm", torch.float32, {}),
    }
    jobs, expected = [], {}
    for name, (family, scheme, norm, fmt, dtype, overrides) in cases.items():
        model = _source(tmp_path, name + "_src", family, dtype, **overrides)
        result = hf_qknorm.convert(
            tmp_path / (name + "_src"),
            tmp_path / name,
            config=QKNormConfig(scheme=scheme, norm=norm, p=3.0 if norm == "lp" else None),
            calibrate=False,
            progress=False,
            log=quiet,
            verify="plugin",
        )  # loading without the plugin is what this test checks below
        assert result.export == fmt
        hf_qknorm.patch_model(model, scheme, norm=norm, p=3.0 if norm == "lp" else None)
        with torch.no_grad():
            expected[name] = model(ids).logits
        jobs.append(
            {
                "name": name,
                "path": str(result.path),
                "remote": fmt == "qknorm",
                "ids": ids.tolist(),
                "mask": torch.ones_like(ids).tolist(),
            }
        )
    got = run_without_plugin(tmp_path, jobs)
    for name, (_, _, _, fmt, dtype, _) in cases.items():
        row = got[name]
        if fmt == "qwen3":
            assert row["cls"] == "Qwen3ForCausalLM" and row["module"].startswith("transformers.models.qwen3")
            torch.testing.assert_close(row["logits"], expected[name], rtol=0, atol=0)  # the same model
        else:
            assert row["module"].startswith("transformers_modules") and row["cls"].startswith("QKNorm")
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(row["logits"], expected[name], rtol=tol, atol=tol)
        assert row["dtype"] == str(dtype)


def test_an_import_the_table_cannot_map_is_refused_at_export(monkeypatch, tmp_path):
    from hf_qknorm.modeling import remote

    for line in (
        "from . import norms\n",
        "from hf_qknorm.portable.norms import make_norm\n",
        "from ..attention import interface\n",
        "from .nowhere import x\n",
    ):
        (tmp_path / "bad.py").write_text('"""doc"""\n' + line)
        monkeypatch.setattr(remote, "_PORTABLE", tmp_path)
        with pytest.raises(RuntimeError, match="bad.py imports"):
            remote.shipped_source("bad")

"""save_pretrained / from_pretrained round trips, and loud failure without the plugin."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_qknorm
from tiny_models import FAMILY_NAMES, VOCAB, tiny_model


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("scheme,norm", [("qk_norm_cap", "layernorm"), ("qkv_norm", "rmsnorm"), ("qk_norm", "lp"),
                                         ("soft_cap", None)])
def test_round_trip(tmp_path, family, scheme, norm):
    model = tiny_model(family)
    hf_qknorm.patch_model(model, scheme, norm=norm, p=4.0 if norm == "lp" else None)
    with torch.no_grad():  # trained-looking norm weights, so that losing them would show
        for name, prm in model.named_parameters():
            if "_norm." in name:
                prm.add_(0.3 * torch.randn_like(prm))
    ids = torch.randint(0, VOCAB, (2, 11))
    expected = model(ids).logits
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == f"qknorm_{family}"
    assert saved["qknorm"]["scheme"] == scheme
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf_qknorm.qknorm_config(loaded) == hf_qknorm.qknorm_config(model)
    torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=0)


def test_round_trip_keeps_bf16(tmp_path):
    model = tiny_model("llama", dtype=torch.bfloat16)
    hf_qknorm.patch_model(model, "qk_norm_cap")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}


def test_without_plugin_loading_asks_for_the_shipped_code(tmp_path):
    """Without the plugin, a saved folder never loads as a plain Llama: Transformers refuses it until the user
    trusts the remote code saved in it (which ``tests/test_export.py`` loads and checks)."""
    model = tiny_model("llama")
    hf_qknorm.patch_model(model, "qk_norm")
    model.save_pretrained(tmp_path)
    code = textwrap.dedent(f"""
        import sys
        sys.modules["hf_qknorm"] = None  # the plugin is not installed
        from transformers import AutoModelForCausalLM
        try:
            AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})
        except Exception as exc:
            print("REFUSED:", type(exc).__name__, exc)
            sys.exit(0)
        print("LOADED SILENTLY")
        sys.exit(1)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "REFUSED" in res.stdout and "trust_remote_code=True" in res.stdout

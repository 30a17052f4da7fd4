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
from tests._support.tiny_models import FAMILY_NAMES, VOCAB, tiny_model


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize(
    "scheme,norm", [("qk_norm_cap", "layernorm"), ("qkv_norm", "rmsnorm"), ("qk_norm", "lp"), ("soft_cap", None)]
)
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


@pytest.mark.spawns
def test_without_plugin_loading_asks_for_the_shipped_code(tmp_path):
    """Without the plugin, a saved folder never loads as a plain Llama: Transformers refuses it until the user
    trusts the remote code saved in it (which ``tests/modeling/test_export.py`` loads and checks)."""
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
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "REFUSED" in res.stdout and "trust_remote_code=True" in res.stdout


# --------------------------------------------------------------------------------------------------------------------
# a folder whose norm weights do not match its scheme never loads (issue 22)
# --------------------------------------------------------------------------------------------------------------------
def _edit_weights(folder, edit) -> None:
    """Rewrite ``folder/model.safetensors`` as ``edit(state_dict)`` returns it."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    save_file(edit(load_file(path)), path, metadata={"format": "pt"})


def _drop(pattern):
    return lambda sd: {k: v for k, v in sd.items() if pattern not in k}


def _add(key, make):
    return lambda sd: {**sd, key: make(sd)}


# (family, scheme, norm, edit, key named in the error). Saved by save_pretrained, then edited.
BROKEN_FOLDERS = {
    "every-q_norm-deleted": ("llama", "qk_norm_cap", "layernorm", _drop("q_norm"), "self_attn.q_norm.weight"),
    "one-bias-deleted": (
        "qwen2",
        "qk_norm",
        "layernorm",
        _drop("layers.1.self_attn.k_norm.bias"),
        "missing model.layers.1.self_attn.k_norm.bias",
    ),
    "lp-logit-scale-deleted": ("gpt2", "qk_norm", "lp", _drop("q_norm.weight"), "attn.q_norm.weight"),
    "v_norm-deleted": ("mistral", "qkv_norm", "rmsnorm", _drop("v_norm"), "v_norm.weight"),
    "qwen3-own-norm-deleted": ("qwen3", "soft_cap", None, _drop("layers.0.self_attn.k_norm"), "k_norm.weight"),
    "unexpected-v_norm": (
        "llama",
        "qk_norm",
        "rmsnorm",
        _add("model.layers.0.self_attn.v_norm.weight", lambda sd: torch.ones(16)),
        "v_norm.weight",
    ),
    "unexpected-bias-on-rmsnorm": (
        "llama",
        "qk_norm",
        "rmsnorm",
        _add("model.layers.1.self_attn.q_norm.bias", lambda sd: torch.zeros(16)),
        "q_norm.bias",
    ),
    "unexpected-prenorm-of-qkv_norm": (
        "llama",
        "qkv_norm",
        "layernorm",
        _add("model.layers.0.input_layernorm.weight", lambda sd: torch.ones(64)),
        "input_layernorm.weight",
    ),
}


def _broken_folder(tmp_path, case):
    family, scheme, norm, edit, _ = BROKEN_FOLDERS[case]
    model = tiny_model(family)
    hf_qknorm.patch_model(model, scheme, norm=norm, p=3.0 if norm == "lp" else None)
    folder = tmp_path / case
    model.save_pretrained(folder)
    _edit_weights(folder, edit)
    return folder


@pytest.mark.parametrize("case", list(BROKEN_FOLDERS))
def test_a_folder_whose_norm_weights_do_not_match_its_scheme_never_loads(tmp_path, case):
    from hf_qknorm.portable.weights import SchemeWeightsError

    folder = _broken_folder(tmp_path, case)
    with pytest.raises(SchemeWeightsError, match="norm weights do not match scheme") as err:
        AutoModelForCausalLM.from_pretrained(folder)
    message = str(err.value)
    assert "\n" not in message and BROKEN_FOLDERS[case][4] in message and str(folder) in message
    with pytest.raises(SchemeWeightsError):  # Transformers' own keywords do not open a way around it
        AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, ignore_mismatched_sizes=True)


@pytest.mark.spawns
def test_the_shipped_code_refuses_them_too(tmp_path):
    """The rule lives in the shipped code (qknorm_structure.py), so a user without the plugin is refused alike."""
    folders = [_broken_folder(tmp_path, case) for case in ("every-q_norm-deleted", "unexpected-bias-on-rmsnorm")]
    code = textwrap.dedent(f"""
        import sys
        sys.modules["hf_qknorm"] = None  # the plugin is not installed
        from transformers import AutoModelForCausalLM
        for folder in {[str(f) for f in folders]!r}:
            try:
                AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
                print("LOADED", folder)
            except ValueError as exc:
                print("REFUSED", type(exc).__name__, exc)
    """)
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
    )
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [line for line in res.stdout.splitlines() if line.startswith(("LOADED", "REFUSED"))]
    assert len(lines) == 2 and all(line.startswith("REFUSED SchemeWeightsError") for line in lines), res.stdout
    assert (
        "missing model.layers.*.self_attn.q_norm.bias (layers 0, 1), model.layers.*.self_attn.q_norm.weight" in lines[0]
    )
    assert "unexpected model.layers.1.self_attn.q_norm.bias" in lines[1]


def test_a_norm_weight_of_another_shape_is_refused(tmp_path):
    """Without ``ignore_mismatched_sizes`` Transformers itself refuses; with it, Transformers would re-initialise
    the weight: refused by name."""
    from hf_qknorm.portable.weights import SchemeWeightsError

    model = tiny_model("llama")
    hf_qknorm.patch_model(model, "qk_norm")
    model.save_pretrained(tmp_path)
    _edit_weights(tmp_path, lambda sd: {**sd, "model.layers.1.self_attn.k_norm.weight": torch.ones(32)})
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(SchemeWeightsError, match=r"k_norm.weight has shape \(32,\) in the checkpoint, \(16,\)"):
        AutoModelForCausalLM.from_pretrained(tmp_path, ignore_mismatched_sizes=True)


def test_transformers_loading_keywords_keep_working(tmp_path):
    """``output_loading_info`` and ``ignore_mismatched_sizes`` on a whole folder, a new classification head of
    another size (what ignore_mismatched_sizes is for), and a config cut to fewer layers (a partial load of whole
    layers: their norm weights are left to Transformers' report)."""
    from transformers import AutoModelForSequenceClassification

    model = tiny_model("llama")
    hf_qknorm.patch_model(model, "qk_norm_cap")
    model.save_pretrained(tmp_path / "lm")
    loaded, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "lm", output_loading_info=True, ignore_mismatched_sizes=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    clf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "lm", num_labels=3)
    clf.save_pretrained(tmp_path / "clf")
    again, info = AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "clf", num_labels=5, ignore_mismatched_sizes=True, output_loading_info=True
    )
    assert again.score.weight.shape[0] == 5 and [k for k, *_ in info["mismatched_keys"]] == ["score.weight"]
    one_layer, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "lm", num_hidden_layers=1, output_loading_info=True
    )
    assert len(one_layer.model.layers) == 1 and "model.layers.1.self_attn.q_norm.weight" in info["unexpected_keys"]
    torch.testing.assert_close(
        one_layer.model.layers[0].self_attn.q_norm.weight, model.model.layers[0].self_attn.q_norm.weight, rtol=0, atol=0
    )


def test_a_plain_checkpoint_is_not_loaded_into_a_patched_class(tmp_path):
    """Loading an unpatched checkpoint with a patched config is refused (for qkv_norm it would also drop the
    pre-attention norm's gain, which only patch_model and convert fold): patch_model is the way."""
    from hf_qknorm.modeling.classes import config_class
    from hf_qknorm.portable.weights import SchemeWeightsError
    from tests._support.tiny_models import tiny_config

    tiny_model("llama").save_pretrained(tmp_path)
    base = tiny_config("llama")
    qknorm = hf_qknorm.QKNormConfig("qk_norm", eps=base.rms_norm_eps).to_dict()
    config = config_class("llama")(**base.to_dict(), qknorm=qknorm)
    with pytest.raises(SchemeWeightsError, match="call hf_qknorm.patch_model"):
        AutoModelForCausalLM.from_pretrained(tmp_path, config=config)

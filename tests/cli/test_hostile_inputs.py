"""A round of hostile inputs across the public API, the command line and saved folders (issue 22): each one gives a
clear one-line error naming the bad value (and the valid choices where there are some), or a correct result checked
against an independent reference. The table in docs/verify.md lists them with the test that covers each."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import hf_qknorm
from hf_qknorm.cli.main import main
from tests._support.convert_support import bundled_copy, leftovers, save_source
from tests._support.tiny_models import tiny_model

QUICK = ["--no-calibration", "--quiet", "--verify", "plugin"]
SCHEMES = "'qk_norm', 'soft_cap', 'qk_norm_cap', 'qkv_norm'"


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(Path(folder).rglob("*")):
        if p.is_file():
            h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def edit_weights(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    sd = load_file(path)
    edit(sd)
    save_file(sd, str(path), metadata={"format": "pt"})


def edit_config(folder: Path, edit) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.fixture
def saved(tmp_path):
    """A saved rmsnorm qk_norm Llama folder."""
    hf_qknorm.patch_model(tiny_model("llama"), "qk_norm", norm="rmsnorm").save_pretrained(tmp_path / "m")
    return tmp_path / "m"


@pytest.fixture
def src(tmp_path):
    save_source(tmp_path / "src", "llama")
    return tmp_path / "src"


# --------------------------------------------------------------------------------------------------------------------
# the public API
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["QK_Norm", " qk_norm ", "qk-norm", None, 3])
def test_scheme_names_with_odd_case_or_whitespace(scheme):
    """Not normalised (a saved config must name exactly one scheme): refused, naming the value and the choices."""
    with pytest.raises(ValueError) as err:
        hf_qknorm.patch_model(tiny_model("llama"), scheme)
    assert str(err.value) == f"unknown scheme {scheme!r}; valid schemes: {SCHEMES}"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"eps": "1e-6"}, r"eps must be a positive finite number, got '1e-6'"),
        ({"eps": True}, r"eps must be a positive finite number, got True"),
        ({"eps": torch.tensor(1e-6)}, r"eps must be a positive finite number, got tensor\("),
        ({"scheme": "soft_cap", "softcap": "50"}, r"softcap must be a positive finite number up to 1e\+06, got '50'"),
        ({"scheme": "soft_cap", "softcap": torch.tensor(30.0)}, r"softcap must be .* got tensor\(30\.\)"),
        ({"norm": "lp", "p": "3"}, r"p must be a finite number >= 1 for norm 'lp', got '3'"),
        ({"norm": "lp", "p": float("inf")}, r"p must be a finite number >= 1 for norm 'lp', got inf"),
        ({"norm": "RMSNorm"}, r"unknown norm 'RMSNorm'; valid norms: 'layernorm', 'rmsnorm', 'l2', 'lp'"),
    ],
)
def test_settings_that_are_not_numbers(kwargs, match):
    """A string, a bool or a tensor where a number belongs (a tensor would also make the setting device-bound)."""
    kwargs = {"scheme": "qk_norm", **kwargs}
    with pytest.raises(ValueError, match=match):
        hf_qknorm.patch_model(tiny_model("llama"), kwargs.pop("scheme"), **kwargs)


def test_control_objects_refuse_values_out_of_range():
    model = hf_qknorm.patch_model(tiny_model("llama"), "qk_norm")
    with pytest.raises(ValueError, match=r"tau must be a positive finite number, got nan"):
        hf_qknorm.QKClip(model, tau=float("nan"))
    with pytest.raises(ValueError, match=r"alpha must be a number in \[0, 1\], got 2"):
        hf_qknorm.QKClip(model, alpha=2)
    with pytest.raises(ValueError, match=r"tolerance must be a number between 0 and 1 .* got '1e-3'"):
        hf_qknorm.verify(model, tolerance="1e-3")


def test_an_ill_fitting_4d_mask_through_a_whole_model():
    """A caller's own 4D mask reaches the attention function as is: one covering more keys than there are is
    refused by the backend, naming both shapes (not sliced silently, which would attend by the wrong columns)."""
    model = hf_qknorm.patch_model(tiny_model("llama"), "qk_norm_cap").eval()
    ids = torch.randint(0, 128, (1, 6))
    ok = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    ref = model(ids).logits
    torch.testing.assert_close(model(ids, attention_mask=ok).logits, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"attention mask of shape \(1, 1, 6, 9\) does not fit .* expected"):
        model(ids, attention_mask=torch.ones(1, 1, 6, 9, dtype=torch.bool).tril())


# --------------------------------------------------------------------------------------------------------------------
# saved folders
# --------------------------------------------------------------------------------------------------------------------
NEWER = {  # a config.qknorm entry written by a newer version of this package
    "unknown-field": (
        lambda c: c["qknorm"].update(temperature=2.0),
        r"unknown keys in config.qknorm: \['temperature'\]",
    ),
    "unknown-scheme": (
        lambda c: c["qknorm"].update(scheme="qk_norm_gated"),
        r"unknown scheme 'qk_norm_gated' in config.qknorm; valid: 'qk_norm'",
    ),
    "unknown-norm": (
        lambda c: c["qknorm"].update(norm="dyt"),
        r"unknown norm 'dyt' in config.qknorm; valid: 'layernorm'",
    ),
}


@pytest.mark.parametrize("case", list(NEWER))
def test_a_qknorm_entry_from_a_newer_version(saved, capsys, case):
    edit, match = NEWER[case]
    edit_config(saved, edit)
    with pytest.raises(ValueError, match=match + r".*a folder saved by a newer hf_qknorm\?"):
        AutoModelForCausalLM.from_pretrained(saved)
    for command in ("verify", "inspect"):
        code, _, err = run(capsys, command, saved)
        line = one_line(err)
        assert code == 2 and "newer hf_qknorm" in line, line


def test_a_family_from_a_newer_version(saved, capsys):
    """model_type qknorm_<base> for a base this Transformers lacks: named in one line, before Transformers would look
    for remote code and ask on stdin."""
    edit_config(saved, lambda c: c.update(model_type="qknorm_llama9"))
    for command in ("verify", "inspect"):
        code, out, err = run(capsys, command, saved)
        line = one_line(err)
        assert code == 2 and "model_type 'qknorm_llama9'" in line and "this Transformers does not know" in line, line
        assert "[y/N]" not in out + err


def test_a_norm_weight_stored_in_half_precision_loads_exactly(saved, capsys):
    """Transformers casts a stored float16 gain to the model's float32 exactly: the loaded value is the stored one
    (independent reference: the safetensors tensor itself), and the folder verifies."""
    gain = (torch.rand(16, generator=torch.Generator().manual_seed(0)) + 0.5).half()
    edit_weights(saved, lambda sd: sd.update({"model.layers.0.self_attn.q_norm.weight": gain}))
    loaded = AutoModelForCausalLM.from_pretrained(saved)
    assert loaded.model.layers[0].self_attn.q_norm.weight.dtype == torch.float32
    assert torch.equal(loaded.model.layers[0].self_attn.q_norm.weight.data, gain.float())
    code, out, _ = run(capsys, "verify", saved, "--no-generate")
    assert code == 0 and out.rstrip().endswith("OK")


@pytest.mark.parametrize("shape", [(1, 16), (), (16, 1)])
def test_a_norm_weight_of_another_rank(saved, shape):
    edit_weights(saved, lambda sd: sd.update({"model.layers.1.self_attn.k_norm.weight": torch.ones(shape)}))
    from hf_qknorm.portable.weights import SchemeWeightsError

    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        AutoModelForCausalLM.from_pretrained(saved)
    with pytest.raises(SchemeWeightsError, match=rf"k_norm.weight has shape {re.escape(str(shape))} in the checkpoint"):
        AutoModelForCausalLM.from_pretrained(saved, ignore_mismatched_sizes=True)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_norm_weights_in_a_saved_folder(saved, capsys, value):
    """A NaN/inf gain loads (Transformers does not look at values) and the model computes NaN, which the layer
    checks alone report only as "norms not verified: the layers are off for another reason": inspect flags the
    tensor and verify fails naming it, both exit 1."""
    edit_weights(saved, lambda sd: sd["model.layers.0.self_attn.k_norm.weight"].__setitem__(3, value))
    code, out, _ = run(capsys, "inspect", saved)
    row = [line for line in out.splitlines() if line.startswith("| 0 | k_norm.weight")]
    assert code == 1 and row and row[0].endswith("| F32 | NaN/inf values |"), out
    code, out, _ = run(capsys, "verify", saved)
    last = out.rstrip().splitlines()[-1]
    assert (
        code == 1
        and last.startswith("FAILED: weights:")
        and "model.layers.0.self_attn.k_norm.weight with NaN/inf values" in last
    ), last


def test_a_norm_weight_stored_as_bool(saved, capsys):
    """bool gains load cast to 0/1 (Transformers casts every tensor to the model's dtype); inspect and verify fail
    the folder, naming the tensor and its dtype."""
    edit_weights(
        saved, lambda sd: sd.update({"model.layers.1.self_attn.q_norm.weight": torch.ones(16, dtype=torch.bool)})
    )
    code, out, _ = run(capsys, "inspect", saved)
    assert code == 1 and "| 1 | q_norm.weight | (16,) | 1 | 0 | 1 | 1 | BOOL | not floating point |" in out, out
    code, out, _ = run(capsys, "verify", saved)
    assert code == 1 and "q_norm.weight stored as BOOL (not floating point)" in out.rstrip().splitlines()[-1]


def test_a_non_float_dtype_in_config(saved, capsys):
    edit_config(saved, lambda c: c.update(dtype="int64"))
    code, _, err = run(capsys, "verify", saved)
    line = one_line(err)
    assert code == 2 and str(saved) in line and "torch.int64" in line and "floating-point" in line, line


def test_remote_code_of_an_older_version(saved, capsys):
    """With the plugin, the plugin's classes load a folder even with trust_remote_code=True: its shipped files
    (here from "0.1.0", and broken) never run -- from Transformers 5.5 on, which prefers a registered class to a
    folder's code; 5.4 runs the folder's code when trust_remote_code=True is given (the plugin cannot change that).
    inspect says which version wrote them; add_remote_code replaces them."""
    import transformers
    from packaging.version import Version

    for f in saved.glob("*qknorm*.py"):
        text = f.read_text().split("\n", 1)[1]
        f.write_text(
            f"# Written by hf_qknorm 0.1.0 from somewhere; it is regenerated on every save.\n"
            f"raise ImportError('old shipped code ran')\n{text}"
        )
    if Version(transformers.__version__) < Version("5.5"):
        with pytest.raises(ImportError, match="old shipped code ran"):
            AutoModelForCausalLM.from_pretrained(saved, trust_remote_code=True)
    else:
        model = AutoModelForCausalLM.from_pretrained(saved, trust_remote_code=True)
        assert type(model).__module__ == "hf_qknorm.modeling.classes"
    model = AutoModelForCausalLM.from_pretrained(saved)  # without trust_remote_code: the plugin's, on every version
    assert type(model).__module__ == "hf_qknorm.modeling.classes"
    code, out, _ = run(capsys, "inspect", saved)
    assert code == 0 and "remote code: written by hf_qknorm 0.1.0, not this version" in out
    hf_qknorm.add_remote_code(saved)
    code, out, _ = run(capsys, "inspect", saved)
    assert f"remote code: written by hf_qknorm {hf_qknorm.__version__} (this version)" in out
    assert "old shipped code ran" not in (saved / "qknorm_structure.py").read_text()


def test_a_patched_models_adapter_loaded_into_an_unpatched_model(tmp_path):
    """peft loads an adapter that trains q_norm/k_norm (modules_to_save) into a model without them and says
    nothing: the trained norms are dropped and the model computes plain attention faithfully. verify fails it by
    name. The other way round (a plain adapter on a patched model) is a patched model plus LoRA deltas, and
    verifies against the float64 reference."""
    from peft import LoraConfig, PeftModel, get_peft_model

    lora = hf_qknorm.prepare_lora(hf_qknorm.patch_model(tiny_model("llama", seed=1), "qk_norm", norm="rmsnorm"), r=4)
    with torch.no_grad():
        for name, prm in lora.named_parameters():
            if "lora_B" in name:
                prm.normal_(0, 0.05)
    lora.save_pretrained(tmp_path / "adapter")
    wrong = PeftModel.from_pretrained(tiny_model("llama", seed=1), tmp_path / "adapter")
    report = hf_qknorm.verify(wrong, generate=False)
    assert not report.ok and "peft adapter 'default' trains k_norm, q_norm (modules_to_save)" in str(report)
    right = PeftModel.from_pretrained(
        hf_qknorm.patch_model(tiny_model("llama", seed=1), "qk_norm", norm="rmsnorm"), tmp_path / "adapter"
    )
    assert hf_qknorm.verify(right, generate=False).ok

    plain = get_peft_model(tiny_model("llama", seed=1), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    plain.save_pretrained(tmp_path / "plain-adapter")
    patched = hf_qknorm.patch_model(tiny_model("llama", seed=1), "qk_norm", norm="rmsnorm")
    mixed = PeftModel.from_pretrained(patched, tmp_path / "plain-adapter")
    assert hf_qknorm.verify(mixed, generate=False).ok


# --------------------------------------------------------------------------------------------------------------------
# conversion
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "key,where,value",
    [
        ("model.layers.0.self_attn.k_proj.weight", (0, 0), float("nan")),
        ("model.embed_tokens.weight", (5, 3), float("-inf")),
    ],
)
@pytest.mark.parametrize("verify", ["plugin", "off"])
def test_non_finite_weights_in_a_source_checkpoint(src, tmp_path, capsys, key, where, value, verify):
    """Caught before any work, not only by the written model's verification (a multi-line report, "norms not
    verified", and nothing at all with --verify off): one line naming the tensor, exit 2, nothing written."""
    edit_weights(src, lambda sd: sd[key].__setitem__(where, value))
    before = digest(src)
    code, _, err = run(capsys, "convert", src, tmp_path / "o", "--no-calibration", "--quiet", "--verify", verify)
    line = one_line(err)
    assert code == 2 and f"source tensor {key} in model.safetensors has" in line and "non-finite" in line, line
    assert not (tmp_path / "o").exists() and not leftovers(tmp_path) and digest(src) == before


def test_non_finite_gain_folded_by_qkv_norm_and_in_calibration(src, tmp_path, capsys):
    """The pre-attention gain that qkv_norm folds into the projections, and a tensor calibration streams."""
    edit_weights(src, lambda sd: sd["model.layers.1.input_layernorm.weight"].__setitem__(2, float("inf")))
    code, _, err = run(capsys, "convert", src, tmp_path / "o", *QUICK, "--scheme", "qkv_norm")
    assert code == 2 and "source tensor model.layers.1.input_layernorm.weight" in one_line(err)
    tiny = bundled_copy(tmp_path / "tiny")
    edit_weights(tiny, lambda sd: sd["model.layers.1.self_attn.q_proj.weight"].__setitem__((1, 1), float("nan")))
    code, _, err = run(
        capsys,
        "convert",
        tiny,
        tmp_path / "o",
        "--quiet",
        "--verify",
        "off",
        "--block-len",
        "32",
        "--calibration-blocks",
        "2",
        "--eval-blocks",
        "2",
        "--local-steps",
        "0",
    )
    assert code == 2 and "source tensor model.layers.1.self_attn.q_proj.weight" in one_line(err)
    assert not (tmp_path / "o").exists() and not leftovers(tmp_path)


def test_a_tokenizer_larger_than_the_embedding(tmp_path, capsys):
    """Ids past the embedding's last row index nothing (a device assert on CUDA, mid-training): refused before any
    work. A tokenizer smaller than the embedding (a vocabulary padded to a multiple of 64) is normal and accepted."""
    tiny = bundled_copy(tmp_path / "tiny")
    tok = json.loads((tiny / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    rows = json.loads((tiny / "config.json").read_text())["vocab_size"]
    assert len(vocab) == rows
    vocab.update({f"extra{i}": rows + i for i in range(100)})
    (tiny / "tokenizer.json").write_text(json.dumps(tok))
    for extra in ([], QUICK):
        code, _, err = run(capsys, "convert", tiny, tmp_path / "o", "--quiet", *extra)
        line = one_line(err)
        assert code == 2 and f"has {rows + 100:,} tokens but the embedding has {rows:,} rows" in line, line
    assert not (tmp_path / "o").exists()
    edit_config(tiny, lambda c: c.update(vocab_size=rows + 128))  # a padded embedding: more rows than tokens
    edit_weights(
        tiny,
        lambda sd: sd.update(
            {k: torch.cat([v, torch.zeros(128, v.shape[1])]) for k, v in list(sd.items()) if v.shape[0] == rows}
        ),
    )
    code, _, err = run(capsys, "convert", tiny, tmp_path / "o", *QUICK)
    assert code == 0, err


def test_a_destination_that_is_the_source_or_leads_into_it(src, tmp_path, capsys):
    before = digest(src)
    os.symlink(src, tmp_path / "link")
    for dst in (src, tmp_path / "link", src / "sub", tmp_path / "link" / "sub"):
        code, _, err = run(capsys, "convert", src, dst, *QUICK, "--overwrite")
        line = one_line(err)
        assert code == 2 and f"overlaps the source {src}" in line, line
    assert digest(src) == before and os.path.islink(tmp_path / "link") and not (src / "sub").exists()


def test_a_symlinked_destination_elsewhere(src, tmp_path, capsys):
    """The link is followed: without --overwrite the real folder is named and left alone; with it, the real folder
    is replaced atomically and the link is kept (pointing at the converted model)."""
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "keep.txt").write_text("mine")
    os.symlink(tmp_path / "real", tmp_path / "link")
    code, _, err = run(capsys, "convert", src, tmp_path / "link", *QUICK)
    assert code == 2 and f"destination {tmp_path / 'real'} already exists" in one_line(err)
    assert os.listdir(tmp_path / "real") == ["keep.txt"]
    code, _, err = run(capsys, "convert", src, tmp_path / "link", *QUICK, "--overwrite")
    assert code == 0, err
    assert os.path.islink(tmp_path / "link") and (tmp_path / "link" / "config.json").is_file()
    assert not (tmp_path / "real" / "keep.txt").exists() and not leftovers(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "link")
    assert hf_qknorm.qknorm_config(loaded).scheme == "qk_norm_cap"


@pytest.mark.parametrize("name", ["a\nb", "out\x1b[2J", "tab\there", "sp ace -x"])
def test_a_destination_name_with_control_characters(src, tmp_path, capsys, name):
    """Legal file names, written exactly as given (hostile text in the model card is escaped:
    tests/conversion/test_hub.py);
    the written folder loads as the scheme asked for."""
    code, _, err = run(capsys, "convert", src, tmp_path / name, *QUICK)
    assert code == 0, err
    assert sorted(os.listdir(tmp_path)) == sorted(["src", name]) and not leftovers(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / name)
    assert hf_qknorm.qknorm_config(loaded).scheme == "qk_norm_cap"


@pytest.mark.parametrize(
    "flag,value,match",
    [
        ("--scheme", "QK_NORM", rf"unknown scheme 'QK_NORM'; valid schemes: {SCHEMES}"),
        ("--norm", "RMSNorm", r"unknown norm 'RMSNorm'; valid norms: 'layernorm', 'rmsnorm', 'l2', 'lp'"),
        ("--softcap", "nan", r"softcap must be a positive finite number up to 1e\+06, got nan"),
        ("--eps", "-1", r"eps must be a positive finite number, got -1.0"),
    ],
)
def test_cli_settings_with_odd_case_or_values(src, tmp_path, capsys, flag, value, match):
    code, _, err = run(capsys, "convert", src, tmp_path / "o", *QUICK, flag, value)
    assert code == 2 and re.search(match, one_line(err)), err
    assert not (tmp_path / "o").exists()


def test_verify_and_inspect_on_a_file_or_nothing(tmp_path, capsys):
    (tmp_path / "file.bin").write_bytes(b"\x00" * 10)
    for command in ("verify", "inspect"):
        for target in (tmp_path / "file.bin", tmp_path / "absent"):
            code, _, err = run(capsys, command, target)
            line = one_line(err)
            assert code == 2 and str(target) in line, line


@pytest.mark.parametrize("case", ["binary", "empty", "a-folder"])
def test_calibration_text_that_is_not_text(tmp_path, capsys, case):
    """Checked before the model is loaded: one line naming the file and what is wrong."""
    tiny = bundled_copy(tmp_path / "tiny")
    path = {"binary": tmp_path / "bin.txt", "empty": tmp_path / "empty.txt", "a-folder": tmp_path / "tiny"}[case]
    if case == "binary":
        path.write_bytes(bytes(range(256)) * 4)
    elif case == "empty":
        path.write_text("")
    code, _, err = run(
        capsys, "convert", tiny, tmp_path / "o", "--quiet", "--verify", "off", "--calibration-text", path
    )
    line = one_line(err)
    wanted = {"binary": "is not UTF-8 text", "empty": "text file is empty", "a-folder": "not a regular file"}[case]
    assert code == 2 and wanted in line and str(path.name) in line, line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "flag,value,match",
    [
        ("--block-len", "1", r"block_len must be >= 2, got 1"),
        ("--calibration-blocks", "0", r"calibration_blocks must be >= 1, got 0"),
        ("--local-lr", "nan", r"local_lr must be positive, got nan"),
        ("--local-steps", "-3", r"local_steps must be >= 0, got -3"),
    ],
)
def test_calibration_settings_out_of_range(src, tmp_path, capsys, flag, value, match):
    code, _, err = run(capsys, "convert", src, tmp_path / "o", "--quiet", "--verify", "off", flag, value)
    assert code == 2 and re.search(match, one_line(err)), err

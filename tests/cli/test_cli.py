"""The ``hf-qknorm`` command line under operational errors: every case through the real entry point
(:func:`hf_qknorm.cli.main`), asserting one ``error: ...`` line on stderr that names the bad value, the exit status,
and that nothing was left behind. File-system failures are raised where the real ones are (safetensors' own error
type and text for a full disk, ``mkdtemp`` for a read-only folder), and for real on a small tmpfs where the test may
mount one."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import hf_qknorm.conversion.orchestration.converter as converter
from hf_qknorm import QKNormConfig
from hf_qknorm.cli.main import main
from tests._support.convert_support import leftovers, save_source

QUICK = ["--no-calibration", "--quiet", "--verify", "plugin"]


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture
def src(tmp_path):
    save_source(tmp_path / "src", "llama")
    return tmp_path / "src"


# --------------------------------------------------------------------------------------------------------------------
# the file system
# --------------------------------------------------------------------------------------------------------------------
def test_full_disk_while_writing_a_shard(src, tmp_path, capsys, monkeypatch):
    """safetensors reports a full disk as its own SafetensorError with the errno in the text (as it does on a full
    tmpfs): one line that names the destination and ENOSPC; nothing left, an existing destination unchanged."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    dst = tmp_path / "out"
    code, _, err = run(capsys, "convert", src, dst, *QUICK)
    line = one_line(err)
    assert code == 2 and "No space left on device" in line and "ENOSPC" in line and str(dst) in line
    assert not dst.exists() and leftovers(tmp_path) == []
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    code, _, err = run(capsys, "convert", src, dst, *QUICK, "--overwrite")
    assert code == 2 and "ENOSPC" in one_line(err) and f"{dst} is unchanged" in err
    assert os.listdir(dst) == ["keep.txt"] and leftovers(tmp_path) == []


def test_full_disk_while_writing_json(src, tmp_path, capsys, monkeypatch):
    real = Path.write_text

    def write_text(self, *args, **kwargs):
        if self.name == "qknorm_conversion.json":
            raise OSError(errno.ENOSPC, "No space left on device")  # write() on a full disk: no file name
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    code, _, err = run(capsys, "convert", src, tmp_path / "out", *QUICK)
    assert code == 2 and "ENOSPC" in one_line(err) and str(tmp_path / "out") in err
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_read_only_destination(src, tmp_path, capsys, monkeypatch):
    parent = tmp_path / "readonly"
    parent.mkdir()
    real = tempfile.mkdtemp

    def mkdtemp(*args, **kwargs):  # what a read-only file system answers (chmod does not stop root)
        if Path(kwargs.get("dir", "")) == parent:
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*args, **kwargs)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    code, _, err = run(capsys, "convert", src, parent / "out", *QUICK)
    line = one_line(err)
    assert code == 2 and "Read-only file system" in line and "EROFS" in line and str(parent) in line
    assert os.listdir(parent) == []
    # found before the hour of calibration, not after it
    monkeypatch.setattr(converter, "_calibrated", lambda *a: pytest.fail("calibration ran"))
    code, _, err = run(capsys, "convert", src, parent / "deeper" / "out", "--quiet")
    assert code == 2 and "EROFS" in one_line(err) and os.listdir(parent) == []
    (tmp_path / "afile").write_text("")
    code, _, err = run(capsys, "convert", src, tmp_path / "afile" / "out", "--quiet")
    assert code == 2 and f"{tmp_path / 'afile'} is a file, not a folder" in one_line(err)


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


@pytest.mark.spawns
def test_real_full_and_read_only_file_system(src, tmp_path, capsys):
    """The same on a real 64 KiB tmpfs (where this process may mount one): full, then remounted read-only."""
    mnt = tmp_path / "mnt"
    if not _mount_tmpfs(mnt, "64k"):
        pytest.skip("cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN)")
    try:
        code, _, err = run(capsys, "convert", src, mnt / "out", *QUICK)
        line = one_line(err)
        assert code == 2 and "ENOSPC" in line and str(mnt / "out") in line and os.listdir(mnt) == []
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        code, _, err = run(capsys, "convert", src, mnt / "deeper" / "out", *QUICK)
        line = one_line(err)
        assert code == 2 and "EROFS" in line and str(mnt / "deeper") in line
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# --------------------------------------------------------------------------------------------------------------------
# the source
# --------------------------------------------------------------------------------------------------------------------
def test_missing_and_unreadable_source(src, tmp_path, capsys, monkeypatch):
    code, _, err = run(capsys, "convert", tmp_path / "nowhere", tmp_path / "o", *QUICK)
    assert code == 2 and "source folder not found" in one_line(err) and str(tmp_path / "nowhere") in err
    real = Path.read_text

    def read_text(self, *args, **kwargs):
        if self == src / "config.json":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    code, _, err = run(capsys, "convert", src, tmp_path / "o", *QUICK)
    line = one_line(err)
    assert code == 2 and "Permission denied" in line and str(src / "config.json") in line and "EACCES" in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("text,kind", [("[1, 2, 3]", "array (list)"), ('"llama"', "string"), ("null", "null")])
def test_json_list_as_config(src, tmp_path, capsys, text, kind):
    """A config.json that is valid JSON but no object: one line naming the file and what it holds, from every
    command (our own check: Transformers' own message for it differs between versions)."""
    (src / "config.json").write_text(text)
    for argv in (
        ["convert", src, tmp_path / "o", *QUICK],
        ["inspect", src],
        ["verify", src],
        ["verify", src, "--no-plugin"],
    ):
        code, _, err = run(capsys, *argv)
        line = one_line(err)
        assert code == 2 and f"config.json is not a model config: a JSON {kind}, not an object" in line, (argv, line)
    assert not (tmp_path / "o").exists()


def _overlapping(path: Path) -> tuple[str, str]:
    """Rewrite a safetensors file so that two tensors of the same size share their bytes."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    by_size: dict[int, list[str]] = {}
    for key, info in header.items():
        if key != "__metadata__":
            begin, end = info["data_offsets"]
            by_size.setdefault(end - begin, []).append(key)
    a, b = next(sorted(keys)[:2] for keys in by_size.values() if len(keys) >= 2)
    header[b]["data_offsets"] = list(header[a]["data_offsets"])  # b would silently read a's values
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n :])
    return a, b


def test_overlapping_safetensors_offsets(src, tmp_path, capsys):
    a, b = _overlapping(src / "model.safetensors")
    code, _, err = run(capsys, "convert", src, tmp_path / "o", *QUICK)
    line = one_line(err)
    assert code == 2 and "overlap" in line and a in line and b in line and str(src / "model.safetensors") in line
    assert not (tmp_path / "o").exists()
    code, _, err = run(capsys, "inspect", src)
    assert code == 2 and "overlap" in one_line(err)


# --------------------------------------------------------------------------------------------------------------------
# settings and the Hub
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_device_without_cuda(src, tmp_path, capsys):
    code, _, err = run(capsys, "convert", src, tmp_path / "o", "--device", "cuda", "--quiet")
    line = one_line(err)
    assert code == 2 and "'cuda'" in line and "--device" in line and "CUDA is not available" in line
    code, _, err = run(capsys, "convert", src, tmp_path / "o", "--device", "gpu", "--quiet")
    assert code == 2 and "unknown device 'gpu'" in one_line(err)
    code, _, err = run(capsys, "verify", src, "--device", "cuda:1")
    assert code == 2 and "cuda:1" in one_line(err)
    assert not (tmp_path / "o").exists()


def test_zero_threads(src, tmp_path, capsys):
    code, _, err = run(capsys, "convert", src, tmp_path / "o", "--threads", "0", "--quiet")
    line = one_line(err)
    assert code == 2 and "--threads" in line and "got 0" in line and not (tmp_path / "o").exists()


def test_hub_unreachable(src, tmp_path, capsys, monkeypatch):
    """A real HfApi against an endpoint where nothing listens: the converted folder is kept, the line names the
    repo, the cause, and how to upload later."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    dst = tmp_path / "out"
    code, _, err = run(capsys, "convert", src, dst, *QUICK, "--push-to-hub", "me/x", "--token", "hf_fake")
    line = one_line(err)
    assert code == 2 and "'me/x'" in line and "ConnectError" in line and f"hf-qknorm push {dst} me/x" in line
    assert (dst / "model.safetensors").is_file() and leftovers(tmp_path) == []
    code, _, err = run(capsys, "push", dst, "me/x", "--token", "hf_fake")
    assert code == 2 and "'me/x'" in one_line(err) and "Connection refused" in err


def test_invalid_repo_id_fails_before_any_work(src, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(converter, "inspect_source", lambda *a: pytest.fail("the source was read"))
    code, _, err = run(capsys, "convert", src, tmp_path / "o", "--push-to-hub", "not a/valid/id", "--quiet")
    assert code == 2 and "invalid Hub repo id 'not a/valid/id'" in one_line(err)
    code, _, err = run(capsys, "push", src, "bad..id", "--token", "x")
    assert code == 2 and "'bad..id'" in one_line(err)
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------------------------------------------------
# usage errors, internal errors, --debug
# --------------------------------------------------------------------------------------------------------------------
def test_usage_errors_are_one_line(capsys):
    for argv, needle in (
        (["convert", "--threads", "x"], "--threads: invalid int value: 'x'"),
        (["convert", "--export", "onnx"], "invalid choice: 'onnx'"),
        ([], "the following arguments are required: command"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2 and needle in one_line(capsys.readouterr().err)


def test_internal_error_and_debug(src, tmp_path, capsys, monkeypatch):
    code, _, err = run(capsys, "--debug", "convert", tmp_path / "nowhere", tmp_path / "o")
    assert code == 2 and "FileNotFoundError" in err and err.strip().splitlines()[-1].startswith("error: source")

    def broken(*args, **kwargs):
        raise TypeError("unsupported operand")

    monkeypatch.setattr(converter, "inspect_source", broken)
    code, _, err = run(capsys, "convert", src, tmp_path / "o", "--quiet")
    line = one_line(err)
    assert code == 3 and "internal error: TypeError: unsupported operand" in line and "--debug" in line
    for argv in (["--debug", "convert", src, tmp_path / "o", "--quiet"], ["convert", src, tmp_path / "o", "--debug"]):
        code, _, err = run(capsys, *argv)
        assert code == 3 and "Traceback (most recent call last)" in err and "in broken" in err
        assert err.strip().splitlines()[-1].startswith("error: internal error: TypeError")


@pytest.mark.spawns
def test_module_entry_point_exit_status(tmp_path):
    """`python -m hf_qknorm.cli` (the console script calls the same main): the status reaches the shell."""
    res = subprocess.run(
        [sys.executable, "-m", "hf_qknorm.cli", "inspect", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 2 and res.stderr.strip() == f"error: folder not found: {tmp_path / 'none'}"


# --------------------------------------------------------------------------------------------------------------------
# inspect
# --------------------------------------------------------------------------------------------------------------------
def test_inspect_prints_norm_statistics(src, tmp_path, capsys):
    import hf_qknorm

    result = hf_qknorm.convert(
        src,
        tmp_path / "out",
        config=QKNormConfig(scheme="qkv_norm", norm="layernorm"),
        calibrate=False,
        progress=False,
        log=lambda *a: None,
        verify="plugin",
    )
    from safetensors.torch import load_file

    weights = load_file(result.path / "model.safetensors")
    weights["model.layers.1.self_attn.v_norm.weight"] = torch.linspace(-1.0, 3.0, 16)  # known statistics
    from safetensors.torch import save_file

    save_file(weights, str(result.path / "model.safetensors"), metadata={"format": "pt"})
    code, out, _ = run(capsys, "inspect", result.path)
    assert code == 0 and '"scheme": "qkv_norm"' in out
    rows = [line for line in out.splitlines() if line.startswith("| 1 | v_norm.weight")]
    t = torch.linspace(-1.0, 3.0, 16, dtype=torch.float64)
    assert rows == [
        f"| 1 | v_norm.weight | (16,) | {t.mean().item():.4g} | {t.std(unbiased=False).item():.4g} | "
        f"-1 | 3 | F32 | ok |"
    ]
    names = [line.split(" | ")[1] for line in out.splitlines() if line.startswith("| 0 |")]
    assert names == ["q_norm.weight", "q_norm.bias", "k_norm.weight", "k_norm.bias", "v_norm.weight", "v_norm.bias"]
    code, out, _ = run(capsys, "inspect", src)  # an unconverted Llama has no norms to show
    assert code == 0 and "norm weights: none" in out


# --------------------------------------------------------------------------------------------------------------------
# calibration text too short: the error names the file the user gave and what was needed vs found
# --------------------------------------------------------------------------------------------------------------------
def test_short_calibration_files_are_named(tmp_path, capsys, monkeypatch):
    from hf_qknorm.data import bundled_text

    monkeypatch.chdir(tmp_path)
    Path("short.txt").write_text(bundled_text()[:3000])  # ~800 tokens: enough to calibrate, its last 10% is not
    Path("tiny.txt").write_text(bundled_text()[:100])
    cases = [
        (
            ["--calibration-text", "short.txt"],
            r"the held-out last 10% of the calibration text 'short.txt' "
            r"\(no eval text was given\) is too short: \d+ tokens, and one "
            r"block of 256 tokens \(255 of text \+ BOS\) is needed",
        ),
        (["--calibration-text", "tiny.txt"], r"^error: calibration text 'tiny.txt' is too short: \d+ tokens"),
        (
            ["--calibration-text", "short.txt", "--eval-text", "tiny.txt"],
            r"^error: eval text 'tiny.txt' is too "
            r"short",
        ),
        (["--calibration-text", "nosuch"], r"^error: calibration text: text file not found: 'nosuch'"),
    ]
    for extra, pattern in cases:
        code, _, err = run(capsys, "convert", "-o", tmp_path / "o", "--quiet", *extra)
        assert code == 2 and re.search(pattern, one_line(err)), err
    assert not (tmp_path / "o").exists()


def test_inspect_flags_norm_weights_that_do_not_match_the_scheme(tmp_path, capsys):
    """Rows a saved folder lacks are shown as MISSING (not left out), and rows it should not have, of
    another shape or not floating point, are flagged; exit 1 (issue 22)."""
    from safetensors.torch import load_file, save_file

    import hf_qknorm
    from tests._support.tiny_models import tiny_model

    model = tiny_model("llama")
    hf_qknorm.patch_model(model, "qk_norm", norm="rmsnorm")
    model.save_pretrained(tmp_path / "m")
    code, out, _ = run(capsys, "inspect", tmp_path / "m")
    assert code == 0 and "| 1 | k_norm.weight | (16,) | 1 | 0 | 1 | 1 | F32 | ok |" in out
    path = tmp_path / "m" / "model.safetensors"
    sd = load_file(path)
    del sd["model.layers.0.self_attn.q_norm.weight"]
    sd["model.layers.0.self_attn.q_norm.bias"] = torch.zeros(16)
    sd["model.layers.1.self_attn.k_norm.weight"] = torch.ones(16, dtype=torch.int64)
    sd["model.layers.1.self_attn.q_norm.weight"] = torch.ones(32)
    save_file(sd, str(path), metadata={"format": "pt"})
    code, out, _ = run(capsys, "inspect", tmp_path / "m")
    assert code == 1
    rows = {tuple(line.split(" | ")[:2]): line for line in out.splitlines() if line.startswith("| ")}
    assert rows[("| 0", "q_norm.weight")].endswith("| MISSING |")
    assert rows[("| 0", "q_norm.bias")].endswith("| UNEXPECTED: not a weight of qk_norm / rmsnorm |")
    assert rows[("| 1", "k_norm.weight")].endswith("| I64 | not floating point |")
    assert rows[("| 1", "q_norm.weight")].endswith("| shape (32,), the scheme needs (16,) |")
    assert out.rstrip().splitlines()[-1] == (
        "norm weights do not match the scheme: 4 tensors flagged above (hf-qknorm verify fails this folder)"
    )


# --------------------------------------------------------------------------------------------------------------------
# a source whose config.json disagrees with its weights (issue 22)
# --------------------------------------------------------------------------------------------------------------------
def test_convert_names_a_config_that_disagrees_with_the_weights(src, tmp_path, capsys):
    """hidden_size edited in config.json (which must not end in "internal error ... This is a bug in hf_qknorm",
    exit 3, after the whole conversion); a tensor missing from the source (a qkv_norm fold would silently skip a
    missing pre-norm gain). Both: one line before any work, exit 2, nothing written."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    cfg["hidden_size"] = 128
    (src / "config.json").write_text(json.dumps(cfg))
    code, _, err = run(capsys, "convert", src, tmp_path / "o", *QUICK)
    line = one_line(err)
    assert code == 2 and "config.json disagrees with the weights" in line, line
    assert re.search(
        r"model\.embed_tokens\.weight is \(128, 64\) in model\.safetensors, \(128, 128\) by config\.json", line
    ), line
    cfg["hidden_size"] = 64
    (src / "config.json").write_text(json.dumps(cfg))
    sd = load_file(src / "model.safetensors")
    del sd["model.layers.1.input_layernorm.weight"]
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    code, _, err = run(capsys, "convert", src, tmp_path / "o", *QUICK, "--scheme", "qkv_norm")
    line = one_line(err)
    assert code == 2 and "lacks model.layers.1.input_layernorm.weight" in line, line
    assert not (tmp_path / "o").exists() and not leftovers(tmp_path)


def test_convert_without_a_tokenizer_says_so(src, tmp_path, capsys):
    """A source without tokenizer files (weights-only checkpoints are legitimate sources) gives a folder without one:
    not silently, and not with a model card whose snippet loads a tokenizer, but with a WARNING line (also with
    --quiet) and a card that says the folder has none (issue 22; the choice is explained in docs/conversion.md)."""
    from hf_qknorm.conversion.output.export import has_tokenizer
    from tests._support.convert_support import bundled_copy

    code, out, _ = run(capsys, "convert", src, tmp_path / "o", *QUICK)
    assert code == 0 and not has_tokenizer(tmp_path / "o")
    warning = [line for line in out.splitlines() if line.startswith("WARNING:")]
    assert len(warning) == 1 and "has no tokenizer" in warning[0] and str(src) in warning[0], out
    card = (tmp_path / "o" / "README.md").read_text()
    assert "AutoTokenizer" not in card and "has no tokenizer" in card
    code, out, _ = run(capsys, "convert", bundled_copy(tmp_path / "tiny"), tmp_path / "o2", *QUICK)
    assert code == 0 and has_tokenizer(tmp_path / "o2") and "WARNING" not in out
    assert "AutoTokenizer.from_pretrained" in (tmp_path / "o2" / "README.md").read_text()


def test_convert_prints_answer_agreement_beside_perplexity(tmp_path, capsys):
    """The figure a user reads before pushing: on the line after the perplexity verdict; --agreement-tokens 0
    leaves it out."""
    small = [
        "--block-len",
        "64",
        "--calibration-blocks",
        "4",
        "--eval-blocks",
        "4",
        "--local-steps",
        "3",
        "--quiet",
        "--verify",
        "plugin",
    ]
    code, out, _ = run(capsys, "convert", "-o", tmp_path / "a", *small, "--agreement-tokens", "4", "--json")
    lines = out.splitlines()
    verdict = next(i for i, line in enumerate(lines) if "of identity init's perplexity increase" in line)
    assert code == 0 and lines[verdict + 1].startswith(
        "answer agreement with the original on 46 prompts (greedy, first 4 new tokens): prefix "
    )
    report = json.loads(lines[-1])["report"]
    assert f"prefix {100 * report['agreement']['prefix']:.1f}%" in lines[verdict + 1]
    code, out, _ = run(capsys, "convert", "-o", tmp_path / "b", *small, "--agreement-tokens", "0")
    assert code == 0 and "answer agreement" not in out


@pytest.mark.parametrize(
    ("name", "unset"),
    [
        ("HF_QKNORM_EXACT_TANH", "tanh.approx.f32 for fp16/bf16 on NVIDIA GPUs"),
        ("HF_QKNORM_NATIVE", "the native op where it was built"),
        ("HF_QKNORM_FUSED_NORMS", "on under Triton's interpreter only"),
        ("HF_QKNORM_TMA", "the tile table decides"),
    ],
)
def test_info_refuses_an_unknown_switch_value_in_one_line(monkeypatch, capsys, name, unset):
    """Every environment switch of the library: a value that is neither on nor off makes ``hf-qknorm info`` (the
    command that says which paths run) print one line naming it and the valid ones, and nothing else; valid
    spellings are reported as what they mean."""
    from hf_qknorm.cli.main import main

    monkeypatch.setenv(name, " Maybe")
    assert main(["info"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        f"error: {name}=' Maybe' is not one of 0, off, false, no, 1, on, true, yes (or unset: {unset})\n"
    )
    for good in ("", " YES ", "off"):
        monkeypatch.setenv(name, good)
        assert main(["info"]) == 0
    capsys.readouterr()


def test_info_says_whether_the_native_op_runs_and_which_tanh(monkeypatch, capsys):
    """``hf-qknorm info`` names the native CPU op's state (in use, off by the switch, or not built), the capped
    tanh's mode and the Transformers version against the tested range."""
    from hf_qknorm import upstream
    from hf_qknorm.attention import native
    from hf_qknorm.cli.main import main

    states = {}
    for name, module, slot in (
        ("in use", object(), "x"),
        ("off", object(), None),
        ("not built", None, None),
    ):
        monkeypatch.setattr(native, "MODULE", module)
        monkeypatch.setattr(native, "NATIVE", [module if slot else None])
        assert main(["info"]) == 0
        out = capsys.readouterr().out
        states[name] = next(line for line in out.splitlines() if line.startswith("native CPU op:"))
        assert "capped tanh:" in out and f"tested {upstream.OLDEST_TESTED} to {upstream.NEWEST_TESTED}" in out
    assert "in use" in states["in use"]
    assert "built, off" in states["off"]
    assert "not built" in states["not built"]


def test_inspect_reads_each_layers_own_norms(tmp_path, capsys):
    """Gemma 4's full-attention layers have heads twice as wide as its sliding ones, and a KV-shared layer has a
    query norm alone: a patched folder of it is all ``ok`` (each layer's norms are the built model's, on ``meta``),
    while a key norm put into that layer, or one of the sliding width on a wide layer, is still flagged."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "gemma4_text" not in CONFIG_MAPPING:
        pytest.skip("gemma4_text is not in this Transformers")
    from safetensors.torch import load_file, save_file

    import hf_qknorm
    from tests._support.tiny_models import kv_shared_gemma4

    model = kv_shared_gemma4()
    hf_qknorm.patch_model(model, "qk_norm_cap", norm="layernorm", softcap=5.0)
    model.save_pretrained(tmp_path / "m")
    code, out, _ = run(capsys, "inspect", tmp_path / "m")
    assert code == 0, out
    assert "| 1 | q_norm.weight | (32,) |" in out and "| 0 | q_norm.weight | (16,) |" in out
    assert "| 2 | k_norm" not in out
    path = tmp_path / "m" / "model.safetensors"
    sd = load_file(path)
    sd["model.layers.2.self_attn.k_norm.weight"] = torch.ones(32)
    sd["model.layers.1.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(sd, str(path), metadata={"format": "pt"})
    code, out, _ = run(capsys, "inspect", tmp_path / "m")
    rows = {tuple(line.split(" | ")[:2]): line for line in out.splitlines() if line.startswith("| ")}
    assert code == 1
    assert rows[("| 2", "k_norm.weight")].endswith("| UNEXPECTED: not a weight of qk_norm_cap / layernorm |")
    assert rows[("| 1", "q_norm.weight")].endswith("| shape (16,), the scheme needs (32,) |")

"""hf_qknorm.convert: calibrated conversion of the bundled model, streaming shards, atomic writes, bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_qknorm
from hf_qknorm import QKNormConfig, convert
from hf_qknorm.conversion.calibration.calibrate import CalibrationSettings
from hf_qknorm.conversion.orchestration.texts import text_blocks
from hf_qknorm.data import bundled_model_dir, split_text
from tests._support.convert_support import SHORT_TEXT, SMALL, bundled_copy, leftovers, quiet, save_source, tree_hash
from tests._support.tiny_models import VOCAB, tiny_model


@pytest.fixture(scope="module")
def bundled_result(tmp_path_factory):
    """The bundled tiny Llama converted once with the default scheme (qk_norm_cap + layernorm)."""
    out = tmp_path_factory.mktemp("conv") / "tiny-qknorm"
    before = tree_hash(bundled_model_dir())
    result = convert(None, out, calibration=SMALL, calibration_text=SHORT_TEXT, progress=False, log=quiet)
    return result, before


@pytest.mark.spawns
def test_bundled_conversion_report_and_files(bundled_result):
    result, _ = bundled_result
    report = result.report
    assert result.export == "qknorm" and result.scheme.scheme == "qk_norm_cap"
    assert report.ppl_calibrated < report.ppl_identity and report.ppl_least_squares < report.ppl_identity
    assert report.ppl_original < report.ppl_identity and math.isfinite(report.recovered)
    assert report.kl_end <= report.kl_start
    assert len(report.layers) == 4 and all(len(s.q_rms) == 4 and len(s.k_rms) == 2 for s in report.layers)
    assert all(s.max_logit_original > 0 and s.max_logit_converted > 0 for s in report.layers)
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "README.md",
        "modeling_qknorm.py",
        "configuration_qknorm.py",
        "qknorm_conversion.json",
    ):
        assert name in result.files
    src = bundled_model_dir()
    for name in ("tokenizer.json", "generation_config.json"):  # carried over byte for byte
        assert (result.path / name).read_bytes() == (src / name).read_bytes()
    saved = json.loads((result.path / "qknorm_conversion.json").read_text())
    assert saved["calibration"]["ppl_calibrated"] == pytest.approx(report.ppl_calibrated)
    assert "| original model |" in report.summary() and "cap c = 50" in report.summary()


def test_bundled_conversion_never_touches_the_source(bundled_result):
    _, before = bundled_result
    assert tree_hash(bundled_model_dir()) == before


def test_written_model_is_the_calibrated_model(bundled_result):
    """Reloading the folder reproduces the calibrated perplexity: what was measured is what was written."""
    result, _ = bundled_result
    model = AutoModelForCausalLM.from_pretrained(result.path)
    assert hf_qknorm.qknorm_config(model) == result.scheme
    tokenizer = AutoTokenizer.from_pretrained(result.path)
    held = split_text(SHORT_TEXT, 0.1)[1]
    blocks = text_blocks(held, tokenizer, SMALL.block_len, SMALL.eval_blocks, "held-out")
    assert hf_qknorm.data.perplexity(model, blocks) == pytest.approx(result.report.ppl_calibrated, rel=1e-5)


def test_bf16_source_stays_bf16(tmp_path):
    src = bundled_copy(tmp_path / "src", dtype=torch.bfloat16)
    result = convert(
        src,
        tmp_path / "out",
        config=QKNormConfig(scheme="qkv_norm", norm="rmsnorm"),
        calibration=SMALL,
        calibration_text=SHORT_TEXT,
        progress=False,
        log=quiet,
        verify="plugin",
    )
    with safe_open(result.path / "model.safetensors", framework="pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        assert "model.layers.0.self_attn.v_norm.weight" in f.keys()
        assert "model.layers.0.input_layernorm.weight" not in f.keys()  # qkv_norm removes the pre-norm
    assert dtypes == {"BF16"}
    assert json.loads((result.path / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(result.path)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert result.report.ppl_calibrated < result.report.ppl_identity


@pytest.mark.parametrize(
    "scheme,norm", [("qk_norm_cap", "layernorm"), ("qkv_norm", "layernorm"), ("qk_norm", "lp"), ("soft_cap", None)]
)
def test_sharded_identity_conversion_equals_patch_model(tmp_path, scheme, norm):
    """Without calibration the written checkpoint is exactly ``patch_model`` of the source, shard by shard
    (including the qkv_norm fold of the pre-norm into the projections)."""
    model = save_source(tmp_path / "src", "llama", max_shard_size="40KB")
    index = json.loads((tmp_path / "src" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    result = convert(
        tmp_path / "src",
        tmp_path / "out",
        config=QKNormConfig(scheme=scheme, norm=norm, p=3.0 if norm == "lp" else None),
        calibrate=False,
        progress=False,
        log=quiet,
        verify="plugin",
    )
    assert result.report is None
    out_index = json.loads((result.path / "model.safetensors.index.json").read_text())
    assert sorted(set(out_index["weight_map"].values())) == shards
    for key, shard in out_index["weight_map"].items():
        with safe_open(result.path / shard, framework="pt") as f:
            assert key in f.keys()
    if scheme != "soft_cap":  # each new norm sits in the shard of its layer's q_proj
        wm = out_index["weight_map"]
        assert wm["model.layers.1.self_attn.q_norm.weight"] == wm["model.layers.1.self_attn.q_proj.weight"]
    hf_qknorm.patch_model(model, scheme, norm=norm, p=3.0 if norm == "lp" else None)
    loaded = AutoModelForCausalLM.from_pretrained(result.path)
    ids = torch.randint(0, VOCAB, (2, 17))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_gpt2_qkv_norm_fold_with_unprefixed_names(tmp_path):
    """GPT-2 checkpoints from the Hub name tensors ``h.0...`` (no ``transformer.``); the pre-norm has a bias,
    folded into c_attn's bias."""
    from safetensors.torch import load_file, save_file

    model = save_source(tmp_path / "src", "gpt2")
    path = tmp_path / "src" / "model.safetensors"
    tensors = load_file(path)
    save_file({k.removeprefix("transformer."): v.contiguous() for k, v in tensors.items()}, path, {"format": "pt"})
    result = convert(
        tmp_path / "src",
        tmp_path / "out",
        config=QKNormConfig(scheme="qkv_norm"),
        calibrate=False,
        progress=False,
        log=quiet,
        verify="plugin",
    )
    with safe_open(result.path / "model.safetensors", framework="pt") as f:
        assert "h.0.attn.v_norm.bias" in f.keys() and "h.0.ln_1.weight" not in f.keys()
    hf_qknorm.patch_model(model, "qkv_norm")
    ids = torch.randint(0, VOCAB, (2, 13))
    loaded = AutoModelForCausalLM.from_pretrained(result.path)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_qwen3_native_norm_carried_without_calibration(tmp_path):
    model = save_source(tmp_path / "src", "qwen3")
    result = convert(
        tmp_path / "src",
        tmp_path / "out",
        config=QKNormConfig(scheme="qk_norm_cap"),
        calibrate=False,
        progress=False,
        log=quiet,
        verify="plugin",
    )
    hf_qknorm.patch_model(model, "qk_norm_cap")  # carries Qwen3's q/k norm gain into the layernorm
    loaded = AutoModelForCausalLM.from_pretrained(result.path)
    ids = torch.randint(0, VOCAB, (1, 9))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_writing_streams_one_shard_at_a_time(tmp_path, monkeypatch):
    """Each shard is read and written before the next is opened (peak memory: about one shard)."""
    save_source(tmp_path / "src", "llama", max_shard_size="40KB")
    events = []
    import safetensors
    import safetensors.torch

    orig_open, orig_save = safetensors.safe_open, safetensors.torch.save_file

    def spy_open(path, *a, **k):
        if Path(path).parent == tmp_path / "src":  # not the checks that read the written folder afterwards
            events.append(("read", str(path).rsplit("/", 1)[-1]))
        return orig_open(path, *a, **k)

    def spy_save(tensors, path, *a, **k):
        events.append(("write", str(path).rsplit("/", 1)[-1]))
        return orig_save(tensors, path, *a, **k)

    monkeypatch.setattr(safetensors, "safe_open", spy_open)
    monkeypatch.setattr(safetensors.torch, "save_file", spy_save)
    convert(
        tmp_path / "src",
        tmp_path / "out",
        config=QKNormConfig(scheme="qk_norm"),
        calibrate=False,
        progress=False,
        log=quiet,
        verify="plugin",
    )
    io = [e for e in events if e[1].startswith("model-")]
    assert io and all(io[i][0] == "read" and io[i + 1] == ("write", io[i][1]) for i in range(0, len(io), 2))


# --------------------------------------------------------------------------------------------------------------------
# destination handling and bad input: a clear error, nothing half-written
# --------------------------------------------------------------------------------------------------------------------
def test_existing_destination_refused_then_overwritten(tmp_path):
    save_source(tmp_path / "src")
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="already exists.*overwrite"):
        convert(tmp_path / "src", dst, calibrate=False, progress=False, log=quiet, verify="plugin")
    assert (dst / "keep.txt").read_text() == "mine"
    convert(tmp_path / "src", dst, calibrate=False, overwrite=True, progress=False, log=quiet, verify="plugin")
    assert not (dst / "keep.txt").exists() and (dst / "model.safetensors").is_file()
    assert leftovers(tmp_path) == []


def test_failure_while_writing_leaves_nothing(tmp_path, monkeypatch):
    import hf_qknorm.conversion.output.export as export

    save_source(tmp_path / "src")

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(export, "copy_side_files", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        convert(
            tmp_path / "src",
            tmp_path / "new" / "deeper" / "out",
            calibrate=False,
            progress=False,
            log=quiet,
            verify="plugin",
        )
    assert not (tmp_path / "new").exists() and leftovers(tmp_path) == []


def _corrupt(path, how):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if how == "truncated" else b"\xff" * 8 + data[8:])


@pytest.mark.parametrize("how", ["truncated", "corrupt"])
def test_bad_safetensors_rejected_before_any_work(tmp_path, how):
    save_source(tmp_path / "src", max_shard_size="40KB")
    shard = sorted((tmp_path / "src").glob("model-*.safetensors"))[1]
    _corrupt(shard, how)
    with pytest.raises(ValueError, match=f"{shard.name}.*(truncated|corrupt)"):
        convert(tmp_path / "src", tmp_path / "out", progress=False, log=quiet, verify="plugin")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_bad_inputs_name_the_problem(tmp_path):
    from transformers import BertConfig, BertModel, LlamaModel

    save_source(tmp_path / "src")
    run = dict(progress=False, log=quiet, verify="plugin")
    with pytest.raises(FileNotFoundError, match="source folder not found"):
        convert(tmp_path / "missing", tmp_path / "o1", **run)
    with pytest.raises(ValueError, match="softcap must be a positive"):
        convert(tmp_path / "src", tmp_path / "o2", QKNormConfig(softcap=0.0), **run)
    with pytest.raises(ValueError, match="softcap must be a positive"):
        convert(tmp_path / "src", tmp_path / "o2", QKNormConfig(softcap=-3), **run)
    with pytest.raises(ValueError, match="calibration text is empty"):
        convert(tmp_path / "src", tmp_path / "o3", calibration_text="   \n  ", **run)
    with pytest.raises(ValueError, match="cannot export as a plain qwen3"):
        convert(tmp_path / "src", tmp_path / "o4", QKNormConfig("qk_norm", "layernorm"), export="qwen3", **run)
    with pytest.raises(ValueError, match="unknown export"):
        convert(tmp_path / "src", tmp_path / "o4", export="onnx", **run)
    with pytest.raises(ValueError, match="overlaps the source"):
        convert(tmp_path / "src", tmp_path / "src" / "inside", **run)
    LlamaModel(tiny_model("llama").config).save_pretrained(tmp_path / "base")
    with pytest.raises(ValueError, match="not a causal language model"):
        convert(tmp_path / "base", tmp_path / "o5", **run)
    BertModel(
        BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37)
    ).save_pretrained(tmp_path / "bert")
    with pytest.raises(ValueError, match="bert is not a causal language model"):
        convert(tmp_path / "bert", tmp_path / "o6", **run)
    convert(tmp_path / "src", tmp_path / "done", calibrate=False, **run)
    with pytest.raises(ValueError, match="already converted"):
        convert(tmp_path / "done", tmp_path / "o7", **run)
    (tmp_path / "src" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model weights"):
        convert(tmp_path / "src", tmp_path / "o8", **run)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "bert", "done", "src"]


def test_calibration_needs_a_tokenizer_and_enough_text(tmp_path):
    save_source(tmp_path / "src")
    with pytest.raises(ValueError, match="calibration needs the source's tokenizer, and .* has no tokenizer files"):
        convert(tmp_path / "src", tmp_path / "o", calibration=SMALL, progress=False, log=quiet, verify="plugin")
    assert not (tmp_path / "o").exists()
    bundled_copy(tmp_path / "tiny")
    with pytest.raises(
        ValueError,
        match=r"calibration text \(the 31-character string given\) is too short: 10 "
        r"tokens, and one block of 64 tokens \(63 of text \+ BOS\) is needed",
    ):
        convert(
            tmp_path / "tiny",
            tmp_path / "o",
            calibration=SMALL,
            calibration_text="To be or not to be.\nThat is it.",
            progress=False,
            log=quiet,
            verify="plugin",
        )
    with pytest.raises(FileNotFoundError, match="text file not found"):
        convert(
            tmp_path / "tiny",
            tmp_path / "o",
            calibration_text="no/such/file.txt",
            progress=False,
            log=quiet,
            verify="plugin",
        )
    assert not (tmp_path / "o").exists() and leftovers(tmp_path) == []


def test_hub_id_without_network_is_a_clear_error(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # never touch the network in tests
    with pytest.raises(FileNotFoundError, match="could not be downloaded from the Hugging Face Hub"):
        convert("someone/some-model", tmp_path / "o", progress=False, log=quiet, verify="plugin")
    assert not (tmp_path / "o").exists()


def test_settings_are_validated():
    with pytest.raises(ValueError, match="steps"):
        CalibrationSettings(steps=-1)
    with pytest.raises(ValueError, match="lr"):
        CalibrationSettings(lr=0.0)


def test_calibrated_qwen3_export_is_the_calibrated_model(tmp_path):
    """Llama + rmsnorm qk_norm, calibrated, written as plain qwen3: Qwen3ForCausalLM reproduces the report."""
    from transformers import Qwen3ForCausalLM

    result = convert(
        None,
        tmp_path / "q3",
        config=QKNormConfig(scheme="qk_norm", norm="rmsnorm"),
        calibration=SMALL,
        calibration_text=SHORT_TEXT,
        progress=False,
        log=quiet,
        verify="plugin",
    )
    assert result.export == "qwen3"
    model = Qwen3ForCausalLM.from_pretrained(result.path)
    blocks = text_blocks(
        split_text(SHORT_TEXT, 0.1)[1],
        AutoTokenizer.from_pretrained(result.path),
        SMALL.block_len,
        SMALL.eval_blocks,
        "held-out",
    )
    assert hf_qknorm.data.perplexity(model, blocks) == pytest.approx(result.report.ppl_calibrated, rel=1e-5)
    assert result.report.ppl_calibrated < result.report.ppl_identity


@pytest.mark.parametrize("norm", ["l2", "lp", "layernorm"])
def test_patched_and_converted_models_start_from_the_same_norms(tmp_path, norm):
    """One rule for identity initialisation: the norms ``patch_model`` gives a model, the ones a conversion without
    calibration writes, and the start of the layer-wise calibration are the same tensors (the l2/lp logit scale
    included, which once used a different length fallback in conversion)."""
    from types import SimpleNamespace

    from hf_qknorm import get_family
    from hf_qknorm.conversion.calibration.layerwise import identity_values
    from hf_qknorm.conversion.calibration.streaming import StreamedCheckpoint
    from hf_qknorm.conversion.orchestration.source import inspect_source
    from hf_qknorm.portable.families import DEFAULT_TRAINING_LENGTH
    from hf_qknorm.portable.norms import henry_logit_scale

    model = save_source(tmp_path / "src", "llama", max_position_embeddings=300)
    kw = dict(norm=norm, p=3.0 if norm == "lp" else None)
    hf_qknorm.patch_model(model, "qk_norm", **kw)
    patched = {n: p for n, p in model.state_dict().items() if "_norm." in n and ("q_norm" in n or "k_norm" in n)}
    if norm != "layernorm":
        assert patched["model.layers.0.self_attn.q_norm.weight"].item() == pytest.approx(henry_logit_scale(300))
    result = convert(
        tmp_path / "src",
        tmp_path / "out",
        QKNormConfig("qk_norm", **kw),
        calibrate=False,
        progress=False,
        log=quiet,
        verify="off",
    )
    with safe_open(result.path / "model.safetensors", framework="pt") as f:
        for name, value in patched.items():
            torch.testing.assert_close(f.get_tensor(name), value, rtol=0, atol=0, msg=name)
    cfg = hf_qknorm.QKNormConfig(scheme="qk_norm", eps=1e-6, **kw)
    source = inspect_source(tmp_path / "src")
    stream = StreamedCheckpoint(source.config, source.family, source.weights, cfg, torch.device("cpu"))
    start = identity_values(stream)
    for name, value in patched.items():
        torch.testing.assert_close(start[name], value, rtol=0, atol=0, msg=name)
    assert get_family("llama").training_length(SimpleNamespace()) == DEFAULT_TRAINING_LENGTH


def test_convert_is_quiet_by_default_and_the_cli_prints_its_report(tmp_path, capsys):
    """The library writes nothing to stdout or stderr unless asked (``log=print``); ``hf-qknorm convert`` asks."""
    from hf_qknorm.cli.main import main

    small = CalibrationSettings(block_len=64, calibration_blocks=2, eval_blocks=2, local_steps=2, agreement_tokens=2)
    result = convert(None, tmp_path / "lib", calibration=small, calibration_text=SHORT_TEXT, verify="plugin")
    assert result.report is not None
    assert capsys.readouterr() == ("", "")
    text = tmp_path / "text.txt"
    text.write_text(SHORT_TEXT)
    argv = ["convert", "-o", str(tmp_path / "cli"), "--calibration-text", str(text), "--block-len", "64"]
    argv += ["--calibration-blocks", "2", "--eval-blocks", "2", "--local-steps", "2", "--agreement-tokens", "2"]
    assert main([*argv, "--verify", "plugin", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("converting hf_qknorm/tiny-llama (bundled) (llama, ")
    assert f"wrote {tmp_path / 'cli'} (qknorm): " in out
    assert "perplexity" in out  # the calibration report's summary
    # the command line's progress handler lives only as long as the command: the library is quiet again after it
    assert main([*argv[:2], str(tmp_path / "cli2"), *argv[3:], "--verify", "plugin"]) == 0
    capsys.readouterr()
    convert(None, tmp_path / "lib2", calibration=small, calibration_text=SHORT_TEXT, verify="plugin")
    assert capsys.readouterr() == ("", "")

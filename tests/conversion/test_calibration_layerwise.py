"""Layer-by-layer calibration streamed from the checkpoint: it reproduces the model's own forward, holds one block
at a time, never makes a layer worse than the closed form, recovers the bundled model, and logs its progress."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_qknorm
from hf_qknorm import convert
from hf_qknorm.conversion.calibration.calibrate import CalibrationSettings, new_norm_parameters
from hf_qknorm.conversion.calibration.layerwise import calibrate_checkpoint
from hf_qknorm.conversion.calibration.streaming import StreamedCheckpoint
from hf_qknorm.conversion.orchestration import progress as progress_mod
from hf_qknorm.conversion.orchestration.source import inspect_source
from hf_qknorm.data import perplexity
from hf_qknorm.portable.schemes import QKNormConfig
from tests._support.convert_support import SHORT_TEXT, bundled_copy, quiet, save_source
from tests._support.tiny_models import VOCAB

FAST = CalibrationSettings(block_len=32, calibration_blocks=4, eval_blocks=6, local_steps=10, batch_size=4)
CASES = [
    ("llama", "qk_norm", "rmsnorm"),
    ("mistral", "qk_norm_cap", "layernorm"),
    ("qwen2", "qkv_norm", "layernorm"),
    ("qwen3", "qk_norm", "rmsnorm"),
    ("gpt2", "qkv_norm", "layernorm"),
    ("llama", "qk_norm", "lp"),
    ("llama", "soft_cap", None),
]
# a Qwen2 whose layers differ in type (full then sliding attention): each block must get its own mask
OVERRIDES = {
    "qwen2": dict(
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
        layer_types=["full_attention", "sliding_attention"],
    ),
    "mistral": dict(sliding_window=8),
}


def _run(tmp_path, family, scheme, norm, settings=FAST, seed=0):
    model = save_source(tmp_path / "src", family, max_shard_size="60KB", **OVERRIDES.get(family, {}))
    source = inspect_source(tmp_path / "src")
    cfg = QKNormConfig(
        scheme,
        norm=norm,
        p=3.0 if norm == "lp" else None,
        eps=float(source.family.norm_eps(source.config)),
    )
    gen = torch.Generator().manual_seed(seed)
    calib = torch.randint(0, VOCAB, (settings.calibration_blocks, settings.block_len), generator=gen)
    held = torch.randint(0, VOCAB, (settings.eval_blocks, settings.block_len), generator=gen)
    stream = StreamedCheckpoint(source.config, source.family, source.weights, cfg, torch.device("cpu"))
    values, report = calibrate_checkpoint(stream, cfg, calib, held, settings, progress=False)
    return model, cfg, values, report, held


def _patched(model, cfg, values):
    hf_qknorm.patch_model(model, cfg)
    params = new_norm_parameters(model)
    assert set(params) == set(values)
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(values[k])
    return model


@pytest.mark.parametrize("family,scheme,norm", CASES)
def test_streamed_report_is_the_models_own_forward(tmp_path, family, scheme, norm):
    """The block-by-block pass reproduces ``perplexity(model)`` of the original model and of the patched model
    with the calibrated values -- per-layer masks, RoPE, GPT-2's positions and the qkv_norm fold included."""
    model, cfg, values, report, held = _run(tmp_path, family, scheme, norm)
    assert report.ppl_original == pytest.approx(perplexity(model, held, batch_size=4), rel=1e-5)
    _patched(model, cfg, values)
    assert report.ppl_calibrated == pytest.approx(perplexity(model, held, batch_size=4), rel=1e-5)
    if family == "qwen3" and norm == "rmsnorm":  # its own q/k norms, kept: the conversion changes nothing
        assert report.ppl_identity == pytest.approx(report.ppl_original, rel=1e-5)
        assert report.ppl_calibrated == pytest.approx(report.ppl_original, rel=1e-5)
    elif cfg.norms_qk:
        assert report.ppl_identity != report.ppl_calibrated
        assert all(s.fit_error <= s.fit_error_closed_form for s in report.layers)
        assert all(s.max_logit_converted > 0 for s in report.layers)


def test_one_block_in_memory_at_a_time(tmp_path, monkeypatch):
    """While a layer is calibrated, every other block of both skeletons is on the meta device (holds no memory)."""
    seen = []
    original_block = StreamedCheckpoint.block

    def spy(self, i, values):
        pair = original_block(self, i, values)
        for model in (self.original, self.patched):
            real = {
                n.split(".")[2]
                for n, p in model.named_parameters()
                if p.device.type != "meta" and n.startswith(self.prefix)
            }
            seen.append(real)
        return pair

    monkeypatch.setattr(StreamedCheckpoint, "block", spy)
    save_source(tmp_path / "src", "llama", num_hidden_layers=4)
    source = inspect_source(tmp_path / "src")
    cfg = QKNormConfig("qk_norm", norm="layernorm", eps=1e-6)
    stream = StreamedCheckpoint(source.config, source.family, source.weights, cfg, torch.device("cpu"))
    ids = torch.randint(0, VOCAB, (3, 16))
    calibrate_checkpoint(stream, cfg, ids, ids, FAST, progress=False)
    assert seen == [{str(i)} for i in range(4) for _ in range(2)]
    assert all(p.device.type == "meta" for m in (stream.original, stream.patched) for p in m.parameters())


def test_a_diverging_fit_keeps_the_closed_form(tmp_path):
    """A step size that makes the local fit worse never reaches the output: the closed form is kept."""
    wild = CalibrationSettings(**{**FAST.__dict__, "local_lr": 200.0, "local_steps": 5})
    _, _, values, report, _ = _run(tmp_path, "llama", "qk_norm", "layernorm", settings=wild)
    kept = [s for s in report.layers if s.fit_error == s.fit_error_closed_form]
    assert kept, "a step size of 200 (x e^200 per step) should lose to the closed form somewhere"
    assert all(s.fit_error <= s.fit_error_closed_form for s in report.layers)


@pytest.mark.spawns
def test_bundled_model_recovers_without_distillation(tmp_path):
    """On the bundled tiny Llama the layer-wise fit alone removes most of identity init's perplexity increase, and
    more than the closed form; the written folder is the model that was measured."""
    settings = CalibrationSettings(block_len=128, calibration_blocks=8, eval_blocks=8, local_steps=60)
    result = convert(
        None,
        tmp_path / "out",
        config=QKNormConfig(scheme="qk_norm", norm="rmsnorm"),
        calibration=settings,
        calibration_text=SHORT_TEXT,
        progress=False,
        log=quiet,
    )
    r = result.report
    assert r.steps == 0 and r.kl_start is None and r.local_steps == 60
    assert r.recovered > 0.9, r.summary()
    assert r.ppl_calibrated < r.ppl_least_squares < r.ppl_identity
    from transformers import AutoTokenizer

    from hf_qknorm.conversion.orchestration.texts import text_blocks
    from hf_qknorm.data import split_text

    model = AutoModelForCausalLM.from_pretrained(result.path)  # a plain qwen3 folder
    blocks = text_blocks(split_text(SHORT_TEXT, 0.1)[1], AutoTokenizer.from_pretrained(result.path), 128, 8, "held")
    assert perplexity(model, blocks, batch_size=4) == pytest.approx(r.ppl_calibrated, rel=1e-5)


def test_progress_lines_without_a_terminal(tmp_path, caplog):
    """Not on a TTY: one INFO line when each stage starts and ends, with counts and elapsed time."""
    caplog.set_level(logging.INFO, logger="hf_qknorm.conversion")
    _run(tmp_path, "llama", "qk_norm", "layernorm", settings=FAST)
    assert not any(r.levelno == logging.INFO for r in caplog.records)  # progress=False: quiet
    caplog.clear()
    model = save_source(tmp_path / "src2", "llama")  # noqa: F841
    source = inspect_source(tmp_path / "src2")
    cfg = QKNormConfig("qk_norm", norm="layernorm", eps=1e-6)
    stream = StreamedCheckpoint(source.config, source.family, source.weights, cfg, torch.device("cpu"))
    ids = torch.randint(0, VOCAB, (2, 16))
    calibrate_checkpoint(stream, cfg, ids, ids, FAST, progress=True)
    text = [r.getMessage() for r in caplog.records]
    assert any("calibrating layer by layer: started (2 layers)" in t for t in text), text
    assert any("calibrating layer by layer: done, 2/2 layers in" in t for t in text), text


def test_heartbeat_at_least_every_interval(caplog):
    """A long stage logs while it runs, whenever HEARTBEAT_S has passed since its last line."""
    caplog.set_level(logging.INFO, logger="hf_qknorm.conversion")
    now = [0.0]
    with progress_mod.Stage("fitting", 10, "steps", clock=lambda: now[0]) as stage:
        for _ in range(10):
            now[0] += progress_mod.HEARTBEAT_S / 2 + 0.01
            stage.update(1)
    lines = [r.getMessage() for r in caplog.records]
    running = [t for t in lines if "running" in t]
    assert lines[0] == "fitting: started (10 steps)" and "done, 10/10 steps" in lines[-1]
    assert len(running) == 5 and "running, 2/10 steps" in running[0]


def test_new_settings_are_validated():
    with pytest.raises(ValueError, match="local_steps must be >= 0"):
        CalibrationSettings(local_steps=-1)
    with pytest.raises(ValueError, match="local_lr must be positive"):
        CalibrationSettings(local_lr=0.0)


def test_cli_defaults_are_the_library_defaults():
    """An empty command line builds exactly the library's default settings (the flags carry no defaults of their
    own)."""
    import argparse

    from hf_qknorm.cli.convert import add_convert
    from hf_qknorm.cli.fields import from_args

    parser = add_convert(argparse.ArgumentParser().add_subparsers())
    assert from_args(CalibrationSettings, parser.parse_args([])) == CalibrationSettings()
    assert from_args(CalibrationSettings, parser.parse_args(["--block-len", "64"])).block_len == 64


@pytest.mark.spawns
def test_bf16_source_calibrates_against_the_written_bits(tmp_path):
    """A bf16 source: calibration reads the tensors that are written (folds in bf16), so the written model
    reproduces the reported calibrated perplexity."""
    src = bundled_copy(tmp_path / "src", dtype=torch.bfloat16)
    settings = CalibrationSettings(block_len=64, calibration_blocks=4, eval_blocks=4, local_steps=10)
    result = convert(
        src,
        tmp_path / "out",
        config=QKNormConfig(scheme="qkv_norm", norm="rmsnorm"),
        calibration=settings,
        calibration_text=SHORT_TEXT,
        progress=False,
        log=quiet,
    )
    model = AutoModelForCausalLM.from_pretrained(result.path, dtype=torch.float32)
    from transformers import AutoTokenizer

    from hf_qknorm.conversion.orchestration.texts import text_blocks
    from hf_qknorm.data import split_text

    blocks = text_blocks(split_text(SHORT_TEXT, 0.1)[1], AutoTokenizer.from_pretrained(result.path), 64, 4, "held")
    # the norm values are rounded to bf16 when written: close, not equal
    assert perplexity(model, blocks, batch_size=4) == pytest.approx(result.report.ppl_calibrated, rel=2e-2)


@pytest.mark.spawns
def test_cli_logs_progress_when_stderr_is_not_a_terminal(tmp_path, capfd):
    """``hf-qknorm convert`` with stderr to a pipe: no bars, one timestamped line per stage; ``--quiet`` (the same
    command line in this process): none."""
    import os
    import subprocess
    import sys

    text = tmp_path / "text.txt"
    text.write_text(SHORT_TEXT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    cmd = [
        sys.executable,
        "-m",
        "hf_qknorm.cli",
        "convert",
        "--calibration-text",
        str(text),
        "--block-len",
        "64",
        "--calibration-blocks",
        "2",
        "--eval-blocks",
        "2",
        "--local-steps",
        "3",
        "--threads",
        "1",
        "--verify",  # the check without the plugin (a second interpreter) logs nothing this test reads
        "plugin",
    ]
    out = subprocess.run(cmd + ["-o", str(tmp_path / "a")], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "calibrating layer by layer: started (4 layers)" in out.stderr
    assert "calibrating layer by layer: done, 4/4 layers in" in out.stderr
    assert "\r" not in out.stderr  # no progress bar redraws in a log
    from hf_qknorm.cli.main import main as cli_main

    capfd.readouterr()
    assert cli_main(cmd[3:] + ["-o", str(tmp_path / "b"), "--quiet"]) == 0
    assert (tmp_path / "b" / "config.json").is_file()
    assert "calibrating layer by layer" not in capfd.readouterr().err


def test_tied_output_head_is_the_embedding(tmp_path):
    """A checkpoint with tied embeddings stores one matrix: the streamed head scores with it."""
    model = save_source(tmp_path / "src", "llama", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    source = inspect_source(tmp_path / "src")
    assert not any(k.startswith("lm_head") for k in source.weights.key_file)
    cfg = QKNormConfig("qk_norm", norm="rmsnorm", eps=1e-6)
    stream = StreamedCheckpoint(source.config, source.family, source.weights, cfg, torch.device("cpu"))
    ids = torch.randint(0, VOCAB, (4, 24), generator=torch.Generator().manual_seed(1))
    _, report = calibrate_checkpoint(stream, cfg, ids, ids, FAST, progress=False)
    assert report.ppl_original == pytest.approx(perplexity(model, ids, batch_size=4), rel=1e-5)


def test_score_computes_the_reference_logits_once(tmp_path, monkeypatch):
    """Scoring several streams against one reference stream gives the figures of computing everything afresh, with
    the reference's output head run once per row (the head of a large vocabulary is most of the cost); a reference
    changed in place is computed again."""
    import math

    from torch.nn import functional as F

    save_source(tmp_path / "src", "llama")
    source = inspect_source(tmp_path / "src")
    cfg = QKNormConfig("qk_norm", norm="rmsnorm", eps=1e-6)
    stream = StreamedCheckpoint(source.config, source.family, source.weights, cfg, torch.device("cpu"))
    blocks = torch.randint(0, VOCAB, (5, 12), generator=torch.Generator().manual_seed(0))
    calls = []
    logits = stream.logits
    monkeypatch.setattr(stream, "logits", lambda x: calls.append(1) or logits(x))

    def fresh(hidden, original):  # the same figures without any reuse
        nll, same, count = 0.0, 0, 0
        for j, h in enumerate(hidden):
            ids = blocks[2 * j : 2 * j + 2]
            for row in range(len(ids)):
                a, b = logits(h[row : row + 1])[0, :-1], logits(original[j][row : row + 1])[0, :-1]
                nll += F.cross_entropy(a, ids[row, 1:], reduction="sum").item()
                same += int((a.argmax(-1) == b.argmax(-1)).sum())
                count += ids.shape[1] - 1
        return math.exp(nll / count), same / count

    with stream.outer():
        original, _ = stream.block_inputs(blocks, 2)
        gen = torch.Generator().manual_seed(1)
        others = [[h + 0.5 * torch.randn(h.shape, generator=gen) for h in original] for _ in range(2)]
        for hidden in (original, *others):
            assert stream.score(hidden, blocks, 2, original) == fresh(hidden, original)
        assert len(calls) == 3 * len(blocks)  # each stream's own rows; the reference's reused
        assert stream.score(others[0], blocks, 2, original)[1] < 1  # the check can tell the streams apart
        original[0].mul_(-1.0)
        calls.clear()
        assert stream.score(others[0], blocks, 2, original) == fresh(others[0], original)
        assert len(calls) == len(blocks) + 2  # the changed batch (2 rows) computed again


def test_the_streamed_models_leave_the_source_config_as_it_was(tmp_path):
    """The streamed original and patched models run on the ``"qknorm"`` backend; the source's config, which the
    conversion goes on reading (a ``qkv_norm`` fold rebuilds a skeleton from it), keeps its own backend -- a vision
    tower whose classes know no ``"qknorm"`` (DeepSeek-VL hybrid's SAM encoder) could not be built from it else."""
    save_source(tmp_path / "src", "llama")
    source = inspect_source(tmp_path / "src")
    before = source.config.to_dict(), source.config._attn_implementation
    cfg = QKNormConfig("qk_norm_cap", norm="rmsnorm", eps=1e-6)
    stream = StreamedCheckpoint(source.config, source.family, source.weights, cfg, torch.device("cpu"))
    assert stream.original.config._attn_implementation == "qknorm"
    assert (source.config.to_dict(), source.config._attn_implementation) == before

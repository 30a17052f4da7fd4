"""A patched model trains with transformers.Trainer (gradient checkpointing on), and a run resumed from a checkpoint
continues exactly like the uninterrupted run -- Q/K learning-rate control and its saved initial norms included."""

from __future__ import annotations

import json

import pytest
import torch

import hf_qknorm
from hf_qknorm import upstream
from tests._support.tiny_models import tiny_model
from tests._support.trainer_runs import CountingText, training_args


def _trainer(out, **kw):
    from transformers import Trainer

    model = tiny_model("llama", seed=3)
    hf_qknorm.patch_model(model, "qk_norm_cap", softcap=20.0)
    return Trainer(
        model=model,
        args=training_args(out, **kw),
        train_dataset=CountingText(),
        callbacks=[hf_qknorm.QKLearningRateCallback(tau=0.5)],
    )


def test_trains_with_checkpointing_and_resumes_identically(tmp_path):
    full = _trainer(tmp_path / "full")
    assert full.model.config._attn_implementation == "qknorm"
    full.train()
    assert upstream.is_checkpointing(full.model)
    losses = [r["loss"] for r in full.state.log_history if "loss" in r]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]

    ckpt = tmp_path / "full" / "checkpoint-3"
    saved = json.loads((ckpt / "trainer_state.json").read_text())["stateful_callbacks"]["QKLearningRateCallback"]
    assert (
        len(saved["attributes"]["restored"]["control"]["initial_norms"]["q"]) == 2
    )  # ||W||_0 travels with the checkpoint
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == "qknorm_llama"

    resumed = _trainer(tmp_path / "resumed")  # a fresh process's view: new model, new callback
    with torch.no_grad():  # the resumed run's initial weights differ from the checkpoint's: they must be loaded
        for p in resumed.model.parameters():
            p.add_(0.01)
    resumed.train(resume_from_checkpoint=str(ckpt))
    resumed_losses = [r["loss"] for r in resumed.state.log_history if "loss" in r and r["step"] > 3]
    torch.testing.assert_close(torch.tensor(resumed_losses), torch.tensor(losses[3:]), rtol=1e-6, atol=1e-6)
    cb = [c for c in resumed.callback_handler.callbacks if isinstance(c, hf_qknorm.QKLearningRateCallback)][0]
    assert cb.controller.initial_norms == saved["attributes"]["restored"]["control"]["initial_norms"]
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def _recipe(name):
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
    return importlib.import_module(name)


@pytest.mark.spawns
def test_recipes_help_and_tiny_runs(tmp_path, capsys):
    """Every recipe answers --help; continued pretraining converts the bundled tiny Llama and trains it, and LoRA
    fine-tunes the result and merges it (from-scratch pretraining runs in tests/training/test_distributed.py)."""

    from hf_qknorm.data import bundled_text

    for name in ("train_scratch", "continue_pretraining", "finetune_lora"):
        with pytest.raises(SystemExit) as exit_info:
            _recipe(name).parse_args(["--help"])
        assert exit_info.value.code == 0 and "--text" in capsys.readouterr().out
    text = tmp_path / "text.txt"
    text.write_text(bundled_text("wikitext2")[:30_000], encoding="utf-8")
    tiny = [
        "--text",
        str(text),
        "--max-steps",
        "2",
        "--batch-size",
        "2",
        "--context",
        "64",
        "--eval-blocks",
        "2",
        "--monitor-every",
        "1",
        "--logging-steps",
        "1",
    ]
    _recipe("continue_pretraining").main(
        tiny + ["--out", str(tmp_path / "cpt"), "--calib-steps", "0", "--calib-blocks", "2", "--qk-lr-tau", "1.0"]
    )
    cpt = json.loads((tmp_path / "cpt" / "results.json").read_text())
    assert cpt["steps"] == 2 and cpt["monitor_last"]["qk/layer3/q_rms"] > 0
    assert abs(cpt["ppl_converted"] / cpt["ppl_source"] - 1) < 0.5  # calibrated: close to the original
    _recipe("finetune_lora").main(tiny + ["--out", str(tmp_path / "lora"), "--model", str(tmp_path / "cpt" / "final")])
    lora = json.loads((tmp_path / "lora" / "results.json").read_text())
    assert lora["ppl_merged"] == pytest.approx(lora["ppl_lora"], rel=1e-4) and lora["ppl_lora"] < lora["ppl_base"]
    assert (tmp_path / "lora" / "adapter" / "adapter_model.safetensors").is_file()
    merged = json.loads((tmp_path / "lora" / "final" / "config.json").read_text())
    assert merged["model_type"] == "qknorm_llama"


def test_pretrain_tiny_recipe_tiny_run(tmp_path):
    """recipes/pretrain_tiny.py (the bundled model's recipe) on two steps: the folder it writes loads as a plain
    Llama with its tokenizer (encodings led by BOS) and finite logits, and has its TRAINING.md."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_qknorm.data import bundled_text

    text = tmp_path / "text.txt"
    text.write_text(bundled_text("tinyshakespeare")[:20_000], encoding="utf-8")
    out = tmp_path / "tiny"
    _recipe("pretrain_tiny").main(
        [
            "--text",
            str(text),
            "--out",
            str(out),
            "--steps",
            "2",
            "--warmup",
            "1",
            "--batch-size",
            "2",
            "--context",
            "32",
            "--vocab-size",
            "300",
            "--hidden-size",
            "32",
            "--layers",
            "1",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--intermediate-size",
            "64",
            "--max-positions",
            "64",
            "--eval-every",
            "1",
            "--eval-blocks",
            "2",
        ]
    )
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == len(tok) <= 300
    ids = tok("ROMEO:\n", return_tensors="pt").input_ids
    assert ids[0, 0].item() == tok.bos_token_id == model.config.bos_token_id
    training = (out / "TRAINING.md").read_text(encoding="utf-8")
    assert "| steps x batch x context | 2 x 2 x 32 " in training and training.count("\n| 1 |") == 1
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()

"""Helpers shared by the conversion, export, CLI and Hub tests (imported by name: tests/ is on pytest's path)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import torch

from hf_qknorm.conversion.calibration.calibrate import CalibrationSettings
from hf_qknorm.data import bundled_model_dir, bundled_text
from tests._support.tiny_models import tiny_model

# Calibration small enough for tests (a few seconds on a CPU): 8 blocks of 64 tokens, 10 distillation steps.
SMALL = CalibrationSettings(
    block_len=64, calibration_blocks=8, eval_blocks=4, steps=10, batch_size=4, agreement_tokens=4
)  # the agreement check runs, short: CI time
SHORT_TEXT = bundled_text()[:40_000]  # tokenising the whole corpus takes seconds; calibration needs little


def quiet(*args, **kwargs):
    pass


def save_source(path: Path, family: str = "llama", dtype=torch.float32, max_shard_size=None, **overrides):
    """A tiny ``family`` model with trained-looking norms (so folds and carried weights matter), saved to ``path``."""
    model = tiny_model(family, dtype=dtype, **overrides)
    with torch.no_grad():
        for prm in model.parameters():
            if prm.dim() == 1:
                prm.add_(0.3 * torch.randn_like(prm))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return model


def bundled_copy(path: Path, dtype=None) -> Path:
    """The bundled tiny Llama copied to ``path`` (re-saved in ``dtype`` when given), tokenizer included."""
    src = bundled_model_dir()
    if dtype is None:
        shutil.copytree(src, path)
        return path
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(src, dtype=dtype).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(src / name, path / name)
    return path


def tree_hash(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (plus their modification times), to prove a folder was not touched."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() + f"@{p.stat().st_mtime_ns}"
        for p in sorted(Path(path).rglob("*"))
        if p.is_file()
    }


def leftovers(parent: Path) -> list[str]:
    """Temporary folders a conversion left beside its destination."""
    return sorted(p.name for p in Path(parent).iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def hook_source_skipping_the_norm(source: str) -> str:
    """The shipped ``qknorm_hooks.py`` source edited so that a projection returns its output unnormalised (one role,
    and each part of a fused projection such as GPT-2's ``c_attn``): remote code that drops the norms silently."""
    one_role = "    norm = modules[name]\n"
    fused = "_norm_heads(attn, r, t) if r else t"
    assert source.count(one_role) == 1 and source.count(fused) == 1, "the shipped hook changed: update this edit"
    return source.replace(one_role, "    return output\n").replace(fused, "t")

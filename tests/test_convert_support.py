"""Helpers shared by the conversion, export and Hub tests (and tests of the safetensors checks they rely on)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from hf_qknorm.conversion.calibrate import CalibrationSettings
from hf_qknorm.conversion.shards import check_safetensors
from hf_qknorm.data import bundled_model_dir, bundled_text
from tiny_models import tiny_model

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


def _header_file(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


def test_check_safetensors_accepts_a_whole_file(tmp_path):
    save_source(tmp_path / "m")
    header = check_safetensors(tmp_path / "m" / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.weight" in header


@pytest.mark.parametrize(
    "case,needle",
    [
        ("short", "truncated"),
        ("huge_header", "header length"),
        ("bad_json", "corrupt header"),
        ("past_end", "truncated"),
        ("wrong_size", "corrupt entry"),
    ],
)
def test_check_safetensors_names_the_problem(tmp_path, case, needle):
    path = tmp_path / "x.safetensors"
    entry = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    if case == "short":
        path.write_bytes(b"\x01\x02")
    elif case == "huge_header":
        path.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    elif case == "bad_json":
        path.write_bytes((5).to_bytes(8, "little") + b"{nope")
    elif case == "past_end":
        _header_file(path, {"t": entry}, b"\0" * 8)
    else:
        _header_file(path, {"t": {**entry, "data_offsets": [0, 12]}}, b"\0" * 16)
    with pytest.raises(ValueError, match=needle) as info:
        check_safetensors(path)
    assert str(path) in str(info.value)

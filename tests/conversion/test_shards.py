"""The safetensors checks every conversion starts with (hf_qknorm/conversion/output/shards.py): a whole file passes,
each kind of damage is named with the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_qknorm.conversion.output.shards import check_safetensors
from tests._support.convert_support import save_source


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

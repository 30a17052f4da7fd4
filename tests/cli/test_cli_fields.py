"""Flags generated from dataclass fields (hf_qknorm/cli/fields.py): types, choices, defaults, help, and that a
flag the user leaves out keeps the dataclass's own default."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Literal

import pytest

from hf_qknorm.cli.fields import add_fields, field_help, from_args, given_fields


@dataclass(frozen=True)
class Settings:
    mode: Literal["a", "b"] = field(default="a", metadata={"help": "which mode"})
    size: int = field(default=3, metadata={"help": "how many"})
    rate: float | None = field(default=None, metadata={"help": "a rate"})
    name: str = field(default="x", metadata={"help": "a name"})
    fast: bool = field(default=False, metadata={"help": "go fast"})

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")


def _parser(**kw):
    p = argparse.ArgumentParser(prog="t")
    add_fields(p, Settings, **kw)
    return p


def test_flags_parse_into_the_dataclass():
    args = _parser().parse_args(["--mode", "b", "--size", "7", "--rate", "0.5", "--name", "y", "--fast"])
    assert from_args(Settings, args) == Settings("b", 7, 0.5, "y", True)


def test_left_out_flags_keep_the_dataclass_defaults():
    args = _parser().parse_args([])
    assert given_fields(Settings, args) == {}
    assert from_args(Settings, args) == Settings()
    assert from_args(Settings, _parser().parse_args(["--no-fast"])).fast is False


def test_choices_are_listed_and_types_enforced(capsys):
    mode = next(a for a in _parser()._actions if "--mode" in a.option_strings)
    assert mode.metavar == "{a,b}" and mode.choices is None  # the dataclass refuses other values, naming them
    with pytest.raises(SystemExit):
        _parser().parse_args(["--size", "two"])
    assert "invalid int value: 'two'" in capsys.readouterr().err


def test_the_dataclass_validates_what_was_typed():
    with pytest.raises(ValueError, match="size must be >= 1, got 0"):
        from_args(Settings, _parser().parse_args(["--size", "0"]))


def test_help_comes_from_the_fields_with_their_defaults():
    text = _parser().format_help()
    assert "which mode (default: a)" in text and "how many (default: 3)" in text and "a rate" in text
    assert "--fast, --no-fast" in text


def test_exclude_and_prefix():
    p = _parser(exclude=("name",), prefix="s_")
    args = p.parse_args(["--s-size", "2"])
    assert from_args(Settings, args, prefix="s_") == Settings(size=2)
    with pytest.raises(SystemExit):
        p.parse_args(["--s-name", "q"])


def test_a_field_without_help_is_refused():
    @dataclass
    class Bare:
        x: int = 1

    with pytest.raises(TypeError, match=r"Bare.x has no metadata\['help'\]"):
        add_fields(argparse.ArgumentParser(), Bare)
    with pytest.raises(TypeError, match="Bare.x"):
        field_help(Bare, "x")


def test_convert_flags_are_the_settings_fields():
    """`hf-qknorm convert`'s scheme, calibration and Hub flags are made from the dataclasses: each field has its
    flag, with the field's help, so neither can drift from the other."""
    import dataclasses

    from hf_qknorm import CalibrationSettings, HubSettings, QKNormConfig
    from hf_qknorm.cli.main import build_parser

    parser, _ = build_parser()
    convert = parser._subparsers._group_actions[0].choices["convert"]
    flags = {opt: action for action in convert._actions for opt in action.option_strings}
    for cls in (QKNormConfig, CalibrationSettings, HubSettings):
        for f in dataclasses.fields(cls):
            flag = "--" + f.metadata.get("flag", f.name).replace("_", "-")
            assert flag in flags, (cls.__name__, f.name)
            assert flags[flag].help.startswith(f.metadata["help"]), (flag, flags[flag].help)
    assert flags["--scheme"].metavar == "{qk_norm,soft_cap,qk_norm_cap,qkv_norm}"


def test_convert_takes_config_objects_only(tmp_path):
    from hf_qknorm import CalibrationSettings, HubSettings, QKNormConfig, convert
    from hf_qknorm.conversion.orchestration.converter import settings_objects

    cfg, cal, hub = settings_objects("qk_norm", None, None)
    assert cfg == QKNormConfig("qk_norm") and cal == CalibrationSettings() and hub == HubSettings()
    for old in ({"scheme": "qk_norm"}, {"settings": CalibrationSettings()}, {"push_to_hub": "me/x"}):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(old))}'"):
            convert(None, tmp_path / "out", **old)  # settings go in as objects, not as these keywords
    assert not (tmp_path / "out").exists()
    with pytest.raises(TypeError, match="calibration must be a CalibrationSettings, got dict"):
        settings_objects(None, {"block_len": 8}, None)
    with pytest.raises(ValueError, match="unknown scheme 'qknorm'"):
        settings_objects("qknorm", None, None)

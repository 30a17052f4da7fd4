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


def test_choices_and_types_are_enforced(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--mode", "c"])
    assert "invalid choice: 'c'" in capsys.readouterr().err
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

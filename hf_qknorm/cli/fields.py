"""Command-line flags made from dataclass fields, so a config object and its flags cannot drift (peft's
``field(metadata={"help": ...})``).

Every field of a settings dataclass (``QKNormConfig``, ``CalibrationSettings``, ...) carries its help text in
``metadata["help"]``. :func:`add_fields` turns the fields into ``--flag`` options: the type comes from the field's
annotation (``Literal[...]`` lists its values, checked by the dataclass, ``X | None`` takes an ``X``, ``bool`` an
on/off pair), the default shown
in ``--help`` is the field's own, and a flag the user does not give is left out of the namespace, so
:func:`from_args` builds the dataclass from what was given and the dataclass's defaults and validation apply, in one
place.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Literal, Union


def _base_type(hint):
    """The type a flag takes for an annotation: ``float | None`` -> ``float`` (leaving the flag out keeps the
    field's default, ``None`` or not)."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"cannot make a flag of the annotation {hint!r}")
        return args[0]
    return hint


def _flag(field: dataclasses.Field, prefix: str) -> str:
    """``--<prefix><name>`` with dashes, or the field's own ``metadata["flag"]`` (a CLI name kept stable when the
    field's name says something else: ``HubSettings.repo_id`` is ``--push-to-hub``)."""
    return "--" + (prefix + field.metadata.get("flag", field.name)).replace("_", "-")


def _default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return ""
    if value is None or isinstance(value, bool):
        return ""
    return f" (default: {value})"


def field_help(cls: type, name: str) -> str:
    """The help text of field ``name`` of dataclass ``cls`` (``TypeError`` when it has none)."""
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    text = field.metadata.get("help")
    if not text:
        raise TypeError(f"{cls.__name__}.{name} has no metadata['help']: every settings field documents itself")
    return text


def add_fields(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *, exclude=(), prefix: str = ""
) -> None:
    """Add a ``--flag`` for each field of dataclass ``cls`` (but those in ``exclude``), named after the field
    (``block_len`` -> ``--block-len``, after ``prefix``), with the field's help and default."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in exclude or not field.init:
            continue
        kind = _base_type(hints[field.name])
        text = field_help(cls, field.name)
        flag, dest = _flag(field, prefix), prefix + field.name
        common = dict(dest=dest, default=argparse.SUPPRESS)
        if kind is bool:
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                help=text + _default_text(field) + (" (default: on)" if field.default is True else ""),
                **common,
            )
        elif typing.get_origin(kind) is Literal:  # the dataclass checks the value: one message, the library's own
            metavar = "{" + ",".join(map(str, typing.get_args(kind))) + "}"
            parser.add_argument(flag, metavar=metavar, help=text + _default_text(field), **common)
        elif kind in (int, float, str):
            metavar = field.metadata.get("metavar", {int: "N", float: "X", str: None}[kind])
            parser.add_argument(flag, type=kind, metavar=metavar, help=text + _default_text(field), **common)
        else:
            raise TypeError(f"cannot make a flag of {cls.__name__}.{field.name}: {hints[field.name]!r}")


def given_fields(cls: type, args: argparse.Namespace, *, prefix: str = "") -> dict[str, Any]:
    """The fields of ``cls`` that the command line set (by :func:`add_fields`), by field name."""
    out = {}
    for field in dataclasses.fields(cls):
        if hasattr(args, prefix + field.name):
            out[field.name] = getattr(args, prefix + field.name)
    return out


def from_args(cls: type, args: argparse.Namespace, *, prefix: str = "", **overrides):
    """``cls(**given, **overrides)``: the dataclass built from the flags given, its own defaults for the rest (so
    its validation runs once, with the values the user typed)."""
    return cls(**{**given_fields(cls, args, prefix=prefix), **overrides})

"""``--help`` of every command, recipe and benchmark: each option states its default at most once, and never as
``(default: None)`` / ``(default: False)`` (``argparse``'s defaults formatter appended one to help that already had
it: ``(default 3) (default: 3)``)."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

from hf_qknorm.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    p for folder in ("recipes", "benchmarks") for p in (ROOT / folder).glob("*.py") if not p.name.startswith("_")
)


def _options(text: str) -> dict[str, str]:
    """Option -> its help text (continuation lines joined), from argparse's help output."""
    out, current = {}, None
    for line in text.splitlines():
        m = re.match(r"^  (-{1,2}[\w-]+|\w[\w-]*)", line)
        if m:
            current = m.group(1)
            out[current] = line
        elif current and line.startswith("    "):
            out[current] += " " + line.strip()
        else:
            current = None
    return out


def _check(text: str, where: str) -> None:
    for option, help_text in _options(text).items():
        assert len(re.findall(r"\(default", help_text, flags=re.I)) <= 1, f"{where} {option}: {help_text}"
        assert "(default: None)" not in help_text and "(default: False)" not in help_text, f"{where} {option}"


def _help(path: Path, args: list[str], capsys, monkeypatch) -> str:
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    with pytest.raises(SystemExit) as info:
        runpy.run_path(str(path), run_name="__main__")
    assert info.value.code in (0, None)
    return capsys.readouterr().out


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_script_help_states_defaults_once(path, capsys, monkeypatch):
    text = _help(path, ["--help"], capsys, monkeypatch)
    assert "usage:" in text
    _check(text, path.name)
    sub = re.search(r"\{(\w+(?:,\w+)+)\}", text.split("\n\n")[0])  # subcommands in the usage line
    for name in sub.group(1).split(",") if sub else []:
        _check(_help(path, [name, "--help"], capsys, monkeypatch), f"{path.name} {name}")


def test_command_line_help_states_defaults_once(capsys):
    for argv in ([], ["convert"], ["push"], ["verify"], ["inspect"], ["demo"], ["info"]):
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        _check(capsys.readouterr().out, " ".join(["hf-qknorm", *argv]))


def test_inspect_help_promises_what_it_prints(capsys):
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "statistics (mean, std, min, max) of its q/k/v norm weights" in text  # tests/cli/test_cli.py: the numbers

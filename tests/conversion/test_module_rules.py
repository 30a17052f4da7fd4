"""Rules of the conversion code's shape (issue 27, items 3 and 5).

- The scheme's config travels whole: conversion and the CLI pass a ``QKNormConfig`` to ``patch_model`` as it is,
  and make a variant with ``dataclasses.replace`` -- never by unpacking its fields and rebuilding it, which silently
  drops a field added later.
- One module never imports another's private names, and token blocks are cut in one place
  (``hf_qknorm.data.tokenize_blocks``), so there is one stride rule."""

import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hf_qknorm"
FANOUT = re.compile(r"norm=cfg\.norm|softcap=cfg\.softcap|\*\*\{\*\*\w+\.to_dict\(\)")


@pytest.mark.parametrize("folder", ["conversion", "cli"])
def test_no_config_fan_out_or_rebuild(folder):
    hits = [
        f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
        for path in sorted((PACKAGE / folder).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if FANOUT.search(line)
    ]
    assert not hits, "pass the QKNormConfig whole / use dataclasses.replace:\n" + "\n".join(hits)


def test_the_guard_sees_a_fan_out():
    assert FANOUT.search("patch_model(m, cfg.scheme, norm=cfg.norm if cfg.norms_qk else None)")
    assert FANOUT.search("QKNormConfig(**{**cfg.to_dict(), 'eps': 1e-6})")
    assert not FANOUT.search("patch_model(m, cfg)")


PRIVATE_IMPORT = re.compile(r"^\s*from \.+[\w.]* import .*\b_[a-z]\w*")


def _lines(folder):
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            yield f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}", line


def test_conversion_imports_no_private_name():
    hits = [where for where, line in _lines("conversion") if PRIVATE_IMPORT.search(line)]
    assert not hits, "make the name public or move it:\n" + "\n".join(hits)
    assert PRIVATE_IMPORT.search("from .shards import SourceWeights, _transform, plan_weights")
    assert not PRIVATE_IMPORT.search("from .shards import SourceWeights, transform_tensor")


def test_token_blocks_are_cut_in_one_place():
    hits = [where for folder in ("conversion", "cli") for where, line in _lines(folder) if ".unfold(" in line]
    assert not hits, "cut token blocks with hf_qknorm.data.tokenize_blocks:\n" + "\n".join(hits)

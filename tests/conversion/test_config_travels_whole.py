"""The scheme's config travels whole (issue 27, item 3): conversion and the CLI pass a ``QKNormConfig`` to
``patch_model`` as it is, and make a variant with ``dataclasses.replace`` -- never by unpacking its fields and
rebuilding it, which silently drops a field added later."""

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

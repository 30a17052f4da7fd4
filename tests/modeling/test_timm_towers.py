"""The multimodal types whose vision towers timm builds (FastVLM's FastViT, Gemma 3n's MobileNet-V5, PerceptionLM's
Perception Encoder): built tiny (the timm model's own constructor arguments, ``tiny.MULTIMODAL``), patched with every
scheme x norm, their text and image checks run as the coverage table runs them. timm is not in the project's
environment: it lives in ``.timm-env`` (scripts/timm_env.sh, which scripts/test.sh runs), put on the path of one child
process. Expected values come from each type's unpatched model in that process (``coverage.check_model_type``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMM_ENV = ROOT / ".timm-env"
TYPES = ("fast_vlm", "gemma3n", "perception_lm")

_CHILD = """
import json, sys
from hf_qknorm.verification import coverage as cov
out = {}
for model_type in sys.argv[1:]:
    result = cov.check_model_type(model_type)
    out[model_type] = {"status": result.status, "reason": result.reason, "variants": result.variants}
print("RESULT " + json.dumps(out))
"""


def _check_in_the_timm_environment() -> dict:
    """Each of :data:`TYPES` through ``coverage.check_model_type`` in one child process with timm on its path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TIMM_ENV), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, *TYPES], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


@pytest.mark.spawns
def test_the_types_whose_vision_towers_timm_builds_are_patched_with_their_images_checked():
    import transformers
    from packaging.version import Version

    from hf_qknorm.upstream import NEWEST_TESTED
    from hf_qknorm.verification import coverage as cov

    if Version(transformers.__version__) < Version(NEWEST_TESTED):
        pytest.skip(f"the classification checked is Transformers {NEWEST_TESTED}'s")
    if not any(TIMM_ENV.glob(".done-*")):
        pytest.skip("no timm environment: scripts/timm_env.sh makes it (scripts/test.sh runs it)")
    results = _check_in_the_timm_environment()
    assert set(results) == set(TYPES)
    for model_type, got in results.items():
        assert got["status"] == cov.PATCHED, (model_type, got)
        assert "text inputs only" not in got["reason"], (model_type, got)  # image forward/backward, features checked
        others = {k: v for k, v in got["variants"].items() if not k.startswith("qkv_norm")}
        assert len(others) >= 9 and set(others.values()) == {"ok"}, (model_type, got["variants"])
        qkv = {v for k, v in got["variants"].items() if k.startswith("qkv_norm")}
        if model_type == "gemma3n":  # its attention normalises v itself
            assert "normalises v itself" in got["reason"] and "ok" not in qkv, got
        else:
            assert qkv == {"ok"}, (model_type, got["variants"])

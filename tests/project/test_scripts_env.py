"""The README's two commands install into the project's own virtual environment (scripts/_venv.sh), never into the
Python that is active: a folder they did not make is refused in one line before anything is installed, a second
environment made by ``lane_env`` sees the project environment's packages behind its own, and no script installs with
a bare ``python3``/``pip``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def _bash(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", code], cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env}, timeout=300
    )


@pytest.mark.spawns
@pytest.mark.parametrize("script", ["setup.sh", "main.sh", "test.sh"])
def test_a_folder_the_scripts_did_not_make_is_refused_before_any_install(tmp_path, script):
    foreign = tmp_path / "someone-elses-env"
    (foreign / "bin").mkdir(parents=True)
    (foreign / "bin" / "python").write_text("#!/bin/sh\necho installed-into-the-wrong-env >&2\nexit 1\n")
    (foreign / "bin" / "python").chmod(0o755)
    proc = _bash(f"bash scripts/{script}", HF_QKNORM_VENV=str(foreign))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(foreign) in lines[0] and "HF_QKNORM_VENV" in lines[0] and "not made by these scripts" in lines[0]
    assert "installed-into-the-wrong-env" not in proc.stderr + proc.stdout


@pytest.mark.spawns
def test_the_environment_folder_is_absolute_and_defaults_to_dot_venv(tmp_path):
    proc = _bash('source scripts/_venv.sh && echo "$VENV|$PY"', HF_QKNORM_VENV="")
    venv, py = proc.stdout.strip().split("|")
    assert proc.returncode == 0 and venv == str(ROOT / ".venv") and py == str(ROOT / ".venv" / "bin" / "python")
    proc = _bash('source scripts/_venv.sh && echo "$VENV"', HF_QKNORM_VENV="rel/env")
    assert proc.stdout.strip() == str(ROOT / "rel" / "env")


@pytest.mark.spawns
def test_a_lane_environment_sees_the_project_packages_behind_its_own(tmp_path):
    """What CI's Transformers lanes and the wheel test rely on: the lane's own site-packages come first (a Transformers
    installed there shadows the project's), the project environment's packages (torch) are found behind them."""
    import torch

    if not torch.__file__.startswith(sysconfig.get_paths()["purelib"]):
        pytest.skip("run by a lane's Python, which sees torch behind its own packages: the project environment runs it")
    lane = tmp_path / "lane"
    proc = _bash(f'source scripts/_venv.sh && lane_env "{lane}"', HF_QKNORM_VENV=sys.prefix)
    assert proc.returncode == 0, proc.stderr
    assert (lane / ".made-by-hf-qknorm").is_file()
    main_site = sysconfig.get_paths()["purelib"]
    probe = (
        "import sys, sysconfig, torch; own = sysconfig.get_paths()['purelib']; "
        "print(sys.path.index(own) < sys.path.index(sys.argv[1]), torch.__file__.startswith(sys.argv[1]))"
    )
    out = subprocess.run(
        [str(lane / "bin" / "python"), "-c", probe, main_site], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["True", "True"], out
    # made once, reused: a second call neither refuses nor rebuilds it
    assert _bash(f'source scripts/_venv.sh && lane_env "{lane}"', HF_QKNORM_VENV=sys.prefix).returncode == 0


def test_no_script_installs_into_the_active_python():
    """Every pip and every hf-qknorm the set-up, test, lint, lane and wheel scripts run is the project environment's
    (``$PY``, ``$VENV``) or a lane's; ``python3`` itself only ever makes a venv."""
    for name in ("setup.sh", "main.sh", "test.sh", "lint.sh", "test_version.sh", "test_wheel.sh"):
        for line in (SCRIPTS / name).read_text().splitlines():
            code = line.split("#", 1)[0].replace("-m pip ", "-m <module> ")
            assert not re.search(r"(^|[\s;(])(python3?|pip3?)\s", code), f"scripts/{name}: {line.strip()}"
            assert not re.search(r"(^|[\s;(])hf-qknorm\s", code), f"scripts/{name}: {line.strip()}"

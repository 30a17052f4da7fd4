#!/usr/bin/env bash
# Install everything hf_qknorm needs on a fresh machine (CPU) into the project's own virtual environment: .venv in the
# clone, or the folder HF_QKNORM_VENV names (scripts/_venv.sh; the Python that is active is never touched). Activate it
# with `. .venv/bin/activate` to use `hf-qknorm` and the package afterwards. torch==2.13.0 first: on the project's
# machines a CPU wheel of it is already on disk, and any other version would pull gigabytes of CUDA packages. Then the
# newest tested Transformers (hf_qknorm/upstream.py NEWEST_TESTED, what the suite runs on), then this package: with its
# `dev` extras (pytest, Triton, ruff, matplotlib: what the tests need) by default, or with the extras named in
# HF_QKNORM_EXTRAS (empty: the package alone, what the main job needs -- scripts/main.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
hf_qknorm_make_env "$VENV"
NEWEST=$($PY -c "import ast; t=open('hf_qknorm/upstream.py').read(); print([n.value.value for n in ast.parse(t).body if isinstance(n, ast.Assign) and getattr(n.targets[0], 'id', '') == 'NEWEST_TESTED'][0])")
$PY -m pip install -q --disable-pip-version-check "torch==2.13.0"
EXTRAS=${HF_QKNORM_EXTRAS-dev}
TARGET=.
if [ -n "$EXTRAS" ]; then TARGET=".[$EXTRAS]"; fi
$PY -m pip install -q --disable-pip-version-check -e "$TARGET" "transformers==$NEWEST"

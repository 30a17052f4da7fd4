#!/usr/bin/env bash
# Install everything hf_qknorm needs on a fresh machine (CPU). torch==2.13.0 first: on the project's machines a CPU
# wheel of it is already on disk, and any other version would pull gigabytes of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q --disable-pip-version-check "torch==2.13.0"
$PY -m pip install -q --disable-pip-version-check -e ".[dev]"

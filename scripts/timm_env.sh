#!/usr/bin/env bash
# The packages that build three multimodal types' vision towers (FastVLM, Gemma 3n, PerceptionLM: timm models), for
# their test (tests/modeling/test_timm_towers.py) and coverage rows, in a folder of their own (.timm-env, put on
# PYTHONPATH as an absolute path by those who use it) rather than in the project's environment. timm needs
# torchvision, and the package index's torchvision for torch 2.13 is a CUDA build: on the CPU torch its compiled
# operators cannot load, and its import then fails registering kernels for two operators it never declared. The
# folder's sitecustomize.py declares their schemas (no kernels: nothing here calls them), so torchvision imports; the
# vision towers use none of its operators. The declarations are written only where timm does not import without
# them: where torchvision matches torch (a CUDA torch, or the CPU wheel beside a CPU torch) `pip install timm` is all
# it takes. Index unreachable: a banner, exit 3 (the tests then skip, saying why).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
DIR=.timm-env
TIMM=1.0.31
TORCHVISION=0.28.0  # the release for torch 2.13
if [ -f "$DIR/.done-$TIMM-$TORCHVISION" ]; then exit 0; fi
rm -rf "$DIR.part"
if ! "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$DIR.part" "timm==$TIMM" \
  "torchvision==$TORCHVISION"; then
  rm -rf "$DIR.part"
  echo "!! scripts/timm_env.sh: timm $TIMM / torchvision $TORCHVISION could not be installed; the tests of the" \
    "vision towers timm builds will be skipped" >&2
  exit 3
fi
if ! PYTHONPATH="$DIR.part" "$PY" -c "import timm" 2>/dev/null; then
  # torchvision's operators did not load (a CUDA build on a CPU torch): declare the two it registers kernels for
  cat > "$DIR.part/sitecustomize.py" <<'PY'
"""torchvision's CUDA build on a CPU torch (scripts/timm_env.sh): its compiled operators cannot load, and its import
then registers fake kernels for nms and qnms, which were never declared. Declaring their schemas lets it import."""

import torch

_LIB = torch.library.Library("torchvision", "DEF")
for _schema in (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
):
    _LIB.define(_schema)
PY
  PYTHONPATH="$DIR.part" "$PY" -c "import timm"  # fails here, with its own message, if that was not the cause
fi
touch "$DIR.part/.done-$TIMM-$TORCHVISION"
rm -rf "$DIR"
mv "$DIR.part" "$DIR"

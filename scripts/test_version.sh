#!/usr/bin/env bash
# One Transformers lane of CI beside the main job: the core subset and the training subset of the tests on one
# Transformers version, in a virtual environment this script makes beside the project's own (.venv-<version> beside
# .venv; scripts/_venv.sh). It sees the project environment's packages (torch, peft, accelerate, ...: run
# scripts/setup.sh first) and installs only that Transformers in front of them.
#
#   bash scripts/test_version.sh oldest      # hf_qknorm/upstream.py: OLDEST_TESTED
#   bash scripts/test_version.sh middle      # hf_qknorm/upstream.py: MIDDLE_TESTED
#   bash scripts/test_version.sh 5.10.4 [pytest arguments]
#
# Core: patching every family and scheme against the reference, save/load, masks and caches, remote-code loading
# without the plugin, the version gate and shims, the CLI, the derived float64 reference per kind of attention,
# multimodal patching and export, FlashAttention routing; Transformers' common model tests on patched Llama and GPT-2.
# Training: Trainer (checkpointing, resume; every control's state through a checkpoint), QK-Clip (under LoRA too),
# Muon, the monitor, Q/K learning rates, and every recipe's tiny run (continued pretraining, LoRA, from-scratch DDP
# over two processes, the LR / Lp sweeps, conversion recovery; the DDP run and conversion recovery: not on the middle lane).
# LANE_VENV=DIR uses (or makes) that environment instead of .venv-<version>.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
if [ ! -x "$PY" ]; then
  echo "$0: the project's environment $VENV is missing; run 'bash scripts/setup.sh' first" >&2
  exit 2
fi
WANT=${1:?usage: scripts/test_version.sh oldest|middle|X.Y.Z [pytest arguments]}
shift
case "$WANT" in
  oldest|middle)
    NAME=$(echo "$WANT" | tr a-z A-Z)_TESTED
    VERSION=$($PY -c "import ast; t=open('hf_qknorm/upstream.py').read(); print([n.value.value for n in ast.parse(t).body if isinstance(n, ast.Assign) and getattr(n.targets[0], 'id', '') == '$NAME'][0])")
    ;;
  *) VERSION=$WANT ;;
esac
LANE=${LANE_VENV:-.venv-$VERSION}
lane_env "$LANE"
"$LANE/bin/python" -m pip install -q --disable-pip-version-check "transformers==$VERSION"
"$LANE/bin/python" -c "import transformers; assert transformers.__version__ == '$VERSION', transformers.__version__"
export ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-AVX512_CORE_BF16}
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
echo "core and training tests on transformers $VERSION"
# Transformers' common model tests of this version too (tests/transformers_suite; CI subset for Llama and GPT-2):
# its sdist's test files are fetched like scripts/test.sh fetches the newest's (index unreachable: skipped, loudly).
fetch_rc=0
"$LANE/bin/python" scripts/fetch_transformers_tests.py || fetch_rc=$?
if [ "$fetch_rc" -eq 3 ]; then
  echo "!! continuing WITHOUT Transformers' common model tests (package index unreachable; see the banner above)" >&2
elif [ "$fetch_rc" -ne 0 ]; then
  exit "$fetch_rc"
fi
CORE=(tests/verification/test_reference.py tests/modeling/test_patching.py tests/modeling/test_save_load.py tests/modeling/test_export.py tests/modeling/test_models.py
      tests/test_upstream.py tests/attention/test_cpu_attention.py tests/cli/test_errors.py tests/cli/test_cli.py tests/transformers_suite
      tests/verification/test_families.py tests/modeling/test_multimodal.py tests/modeling/test_multimodal_export.py
      tests/attention/test_delegation.py)
TRAINING=(tests/training/test_trainer.py tests/training/test_controls.py tests/training/test_qk_clip.py
          tests/training/test_qk_clip_lora.py tests/training/test_muon.py tests/training/test_monitor.py tests/training/test_qk_lr.py
          tests/training/test_training.py tests/recipes/test_lr_sweep.py)
# The two slowest training files (a conversion recipe's tiny run; DDP and FSDP over two processes: a minute of CI's
# two cores per lane) run on the oldest Transformers and the newest (the main suite), not on the middle one.
if [ "$WANT" != middle ]; then
  TRAINING+=(tests/recipes/test_conversion_recovery.py tests/training/test_distributed.py)
fi
LANE_ABS=$(cd "$LANE" && pwd)
HF_QKNORM_SUITE_FAMILIES=llama,gpt2 HF_QKNORM_PYTHON="$LANE_ABS/bin/python" "$LANE/bin/python" -m pytest -q \
  -p no:cacheprovider "${CORE[@]}" "${TRAINING[@]}" "$@"

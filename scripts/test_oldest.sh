#!/usr/bin/env bash
# The core subset of the tests on the OLDEST supported Transformers (hf_qknorm/upstream.py: OLDEST_TESTED), in a
# virtual environment this script makes beside the main one (.venv-oldest). It reuses the main environment's
# packages (torch, peft, ...) and installs only that Transformers version over them.
# Core: patching every family and scheme against the reference, save/load, masks and caches, remote-code loading
# without the plugin, the version gate; Transformers' common model tests on patched Llama and GPT-2.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OLDEST=$($PY -c "import ast,sys; t=open('hf_qknorm/upstream.py').read(); print([n.value.value for n in ast.parse(t).body if isinstance(n, ast.Assign) and n.targets[0].id == 'OLDEST_TESTED'][0])")
VENV=.venv-oldest
if [ ! -x "$VENV/bin/python" ]; then
  $PY -m venv --system-site-packages "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "transformers==$OLDEST"
"$VENV/bin/python" -c "import transformers; assert transformers.__version__ == '$OLDEST', transformers.__version__"
export ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-AVX512_CORE_BF16}
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
echo "core tests on transformers $OLDEST"
# Transformers' common model tests of this version too (tests/transformers_suite; CI subset for Llama and GPT-2):
# its sdist's test files are fetched like scripts/test.sh fetches the newest's (index unreachable: skipped, loudly).
fetch_rc=0
"$VENV/bin/python" scripts/fetch_transformers_tests.py || fetch_rc=$?
if [ "$fetch_rc" -eq 3 ]; then
  echo "!! continuing WITHOUT Transformers' common model tests (package index unreachable; see the banner above)" >&2
elif [ "$fetch_rc" -ne 0 ]; then
  exit "$fetch_rc"
fi
HF_QKNORM_SUITE_FAMILIES=llama,gpt2 HF_QKNORM_PYTHON="$PWD/$VENV/bin/python" "$VENV/bin/python" -m pytest -q \
  -p no:cacheprovider tests/test_reference.py tests/test_patching.py tests/test_save_load.py tests/test_export.py \
  tests/test_models.py tests/test_upstream.py tests/test_cpu_attention.py tests/test_errors.py tests/transformers_suite \
  "$@"
